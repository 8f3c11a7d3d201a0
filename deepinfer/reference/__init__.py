"""The reference backend: plain PyTorch on any torch device. It defines what each op means."""
