"""Model code every service agrees on: config, Qwen2 model, log-probs, TP layouts, engine model, tokenizer.

Trainer, inference engines and weight-sync depend on this package (never on each other), so the
parameter names, the tensor-parallel layouts and the log-prob definition cannot drift apart.
Import the submodules directly (`from services.modeling.qwen2 import Qwen2ForCausalLM`); this
package imports nothing heavy at import time.
"""
