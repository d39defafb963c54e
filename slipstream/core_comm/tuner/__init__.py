"""The tuner: per-size choices measured on the real group (``tuner``), the plan it caches
(``plan``) and the measuring helpers (``measure``)."""
