"""The ``slipstream`` torch.distributed backend (``process_group``), its registration with
torch and exact undo (``registry``), and the DDP communication hook (``ddp_hook``)."""

BACKEND = "slipstream"  # the name torch.distributed knows the backend by
