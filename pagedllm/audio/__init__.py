"""Audio for speech models: the audio tokenizer (codec), waveform I/O, reference voices, and the
cache of encoded reference audio. The model side (codes in, codes out) is in model_executor."""
