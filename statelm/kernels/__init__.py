"""statelm's own CPU kernels: a small C++ extension (torch ops under `torch.ops.statelm`), built once per machine."""
