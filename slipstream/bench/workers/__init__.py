"""The processes the benchmarks launch, one module per benchmark (``comm``: a rank of
``slipstream bench comm``, ...), run as ``python -m slipstream.bench.workers.<name>``, and their
helpers: DeepSpeed's shm allreduce, the peer of ``bench comm`` (``deepspeed_shm``), and a
ResNet-50 for ``bench compile`` where torchvision is missing (``resnet``)."""
