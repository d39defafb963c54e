"""The collective algorithms: shared-memory CPU-Reduce inside a node (``shm``, over the
segment of ``segment``), the same through cross-memory attach on the ranks' own tensors
(``cma``), hierarchical collectives across nodes (``hierarchical``) and CUDA tensors staged
through pinned host memory (``staging``)."""
