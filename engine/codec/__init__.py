"""The codec stage: DAC decode (streamed, batched, deadline-ordered) and the audio tokenizer.

Modules: `config` (JSON configs), `dac` (the ESPnet-Codec DAC), `streaming` (per-session chunked
decode), `stage` (the threaded, deadline-ordered batcher), `ssl` (stream-0 tokenizer),
`tokenizer` (incremental audio -> 9 streams), `tiny` (the tiny random checkpoint), `wavio`,
`synth` (a speech-like test signal), `receptive` (context measurement).
"""
