"""Checkpoint converters into our format (engine/checkpoint.py).

`convert_espnet(src_dir, out_dir, dtype=...)` converts an ESPnet OpusLM experiment directory
(espnet.py; the codec rename is codec.py; bounded-memory writing is stream_write.py).
"""

from engine.convert.errors import ConversionError
from engine.convert.espnet import ConversionReport, convert_espnet

__all__ = ["ConversionError", "ConversionReport", "convert_espnet"]
