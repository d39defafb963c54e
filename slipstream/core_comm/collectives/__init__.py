"""The collective algorithms: shared-memory CPU-Reduce inside a node (``shm``, ``segment``),
the same on the ranks' own tensors through cross-memory attach (``cma``), hierarchical
collectives across nodes (``hierarchical``), CUDA tensors through pinned memory (``staging``)."""
