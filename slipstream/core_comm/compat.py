"""torch.distributed spellings that changed across torch versions."""

import torch.distributed as dist

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
