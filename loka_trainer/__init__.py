"""loka_trainer: FP8 training for large recommendation models (LoKA Probe, Mods, Dispatch) and a Component Benchmark."""
