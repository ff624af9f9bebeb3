"""Code that several processes share but that is not protocol: reading GGUF files, tensor
access and formats, the FFN math, and the serve loop both worker kinds run."""
