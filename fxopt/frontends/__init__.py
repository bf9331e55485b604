"""Front ends: the Python API, the command line and the torch.compile backend."""
