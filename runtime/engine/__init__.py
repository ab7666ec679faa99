"""The engine: request records, sampling parameters, the pure-Python scheduler (token budget,
KV page pool, state slots, preemption), the sampler policy and the engine loop thread that owns
the model runner. Talks to the model only through the `ModelRunner` protocol; never imports
cuda or protocols."""
