"""The tuner: per-size choices measured on the real group (``tuner``), the plan it caches and
every communicator of the pool runs (``plan``), the cost model where nothing was measured
(``model``) and the measuring helpers (``measure``). Usage: ``tuner.py``'s docstring.
"""

from .model import SIZE_CLASSES, model_plan
from .plan import BucketSizes, Entry, TunedPlan, TuneKey
from .tuner import Tuner, TunerCacheWarning, default_cache_dir, load_plan, tuned_communicator

__all__ = ["BucketSizes", "Entry", "SIZE_CLASSES", "TuneKey", "TunedPlan", "Tuner", "TunerCacheWarning",
           "default_cache_dir", "load_plan", "model_plan", "tuned_communicator"]
