"""The drafter's on-disk contract and the tools that write or read it: layout, formats, safetensors I/O,
the quantization-plan resolver, quantize, check and make-random."""
