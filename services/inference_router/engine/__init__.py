"""Inference engines behind one interface (base.Engine): the embedded CPU engine (cpu.py), its
tensor-parallel group across Ray actors (tp.py), and vLLM (vllm_engine.py, GPU, imported lazily)."""
