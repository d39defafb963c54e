"""``slipstream.compile``: the compile strategy chosen by measurement on the first real steps
(``autotuner``; ``api`` puts it in a model's ``forward``), what the search may spend
(``budget``), its settings and report (``config``), the candidates (``strategy``), the check
against eager (``check``), graph breaks and recompiles (``diagnose``), the decision cache
(``cache``), the compile processes (``background``) and their share of the budget
(``bounded``)."""
