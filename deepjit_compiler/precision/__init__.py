"""Precision as a graph rewrite: fp32 engine segments in, fp16/bf16 (casts) or int8 (Q/DQ, calibrated)
segments out, with their accuracy cost measured on the CPU."""
