"""Benchmarks: kernels against their peers and the hardware ceilings, end-to-end decode and
prefill, the text layer, constraints, and `agentic_ab` (A/B replay of agentic traffic). May
import anything, torch included; nothing in the product imports bench."""
