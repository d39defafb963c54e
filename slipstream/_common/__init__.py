"""Helpers every layer shares, importing nothing else of slipstream: the one patch registry
(``patch``), the cache directory and atomic JSON files (``cache``), settings read from dicts,
files and the environment (``settings``), what slipstream did in this process (``record``)
and the version."""
