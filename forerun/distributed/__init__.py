"""More than one process: process groups, collectives and tensor-parallel layers on
``torch.distributed`` (gloo on CPU, NCCL on CUDA)."""
