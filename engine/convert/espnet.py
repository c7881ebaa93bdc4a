"""ESPnet OpusLM checkpoint -> our checkpoint format (engine/checkpoint.py).

Input: an ESPnet experiment directory with `config.yaml` and `model.pth` (or one `*epoch.pth`),
a flat state dict or DeepSpeed's `{"module": state_dict}`. Checked against ESPnet's code
(`espnet2/speechlm/core_lm/ar_parallel.py`, `ar_delay.py`, `module/huggingface.py`,
`espnet_model.py`, `definitions.py`) and the espnet/vllm fork's `convert_opuslm_ckpt.py`:

    corelm.emb.weight              -> model.embed_tokens.weight   (the one table, all 9 streams)
    corelm.decoders.model.X        -> model.X                     (HF LlamaModel / Olmo2Model names)
    corelm.lm_head.weight          -> lm_head.weight
    corelm.head_emb.weight         -> head_emb.weight
    criterion.*                    -> dropped (training loss)
    corelm.decoders.model.…rotary_emb.inv_freq -> dropped after checking it against rope_theta
    anything else                  -> refused, naming the key

Steps, in order; nothing is written before all checks pass:
  1. read config.yaml; check the token layout (token_bias ranges, every special id by name in
     token_list) against engine/vocab.py, and read the prompt layout values ESPnet's preprocessor
     takes from it (`read_prompt_layout`: speaker_prompt_length, pad_speaker_prompt; the values the
     engine cannot serve, such as codec_token_in_use other than 9, are refused naming the field);
  2. read the backbone's HF config.json (`transformer_conf.hf_model_tag`: a local directory or a
     hub id found in the local HF cache; `backbone_config` overrides) -> OpusLMConfig, which carries
     the prompt layout values into config.json;
  3. open the weights with `torch.load(mmap=True, weights_only=True)`, map every name, and check
     names and shapes against `checkpoint.expected_weight_shapes`;
  4. stream the tensors into `model.safetensors` (stream_write.py: bounded memory), write
     config.json, the text tokenizer files (`tokenizer/`) when found locally, and the codec
     (`codec/`, codec.py) when the source has one.
"""

from __future__ import annotations

import functools
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import checkpoint, vocab
from engine.convert import hub
from engine.layout import PromptLayout
from engine.convert.codec import prepare_codec, write_codec
from engine.convert.errors import ConversionError
from engine.convert.readers import load_state, read_yaml
from engine.convert.stream_write import PageDropper, write_safetensors
from engine.convert.xeus import convert_xeus, xeus_inputs

DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}
TOKENIZER_SUBDIR = "tokenizer"

_EXACT = {
    "corelm.emb.weight": "model.embed_tokens.weight",
    "corelm.lm_head.weight": "lm_head.weight",
    "corelm.head_emb.weight": "head_emb.weight",
}
_DECODER = "corelm.decoders.model."
_DROP = "criterion."
_INV_FREQ = "rotary_emb.inv_freq"

# Every id engine/vocab.py names, with the token_list name(s) ESPnet gives it (definitions.py;
# the fork's bootstrap_assets.py looks the same names up). <eou> may be unnamed in older lists.
# ENGINE_STOP is ours: it must be an unused slot in the model's vocabulary.
SPECIAL_NAMES: dict[int, tuple[str, ...]] = {
    vocab.PAD: ("<pad>",),
    vocab.UNK: ("<unk>",),
    vocab.SOS_EOS: ("<sos/eos>",),
    vocab.SYSTEM: ("<system_prompt>",),
    vocab.USER: ("<user_input>",),
    vocab.ASSISTANT: ("<assistant_output>",),
    vocab.EOU: ("<eou>", "<unused_token_11>"),
    vocab.ENGINE_STOP: (f"<unused_token_{vocab.ENGINE_STOP}>",),
    vocab.CODEC_SSL: ("<codec_ssl_start/end>",),
    vocab.TEXT_BPE: ("<text_bpe_start/end>",),
    vocab.SPEAKER: ("<spk_start/end>",),
    vocab.TASK_TEXTLM: ("<textlm_task>",),
    vocab.TASK_ASR: ("<codec_ssl_asr_task>",),
    vocab.TASK_TTS: ("<codec_ssl_tts_task>",),
    vocab.TASK_PLAIN_TTS: ("<codec_ssl_plain_tts_task>",),
    vocab.TASK_AUDIOLM: ("<codec_ssl_audiolm_task>",),
    vocab.TASK_TEXT_DIALOGUE: ("<text_dialogue_task>",),
    vocab.TASK_AUDIO_DIALOGUE: ("<audio_dialogue_task>",),
}
_BACKBONES = {"llama": "llama", "olmo2": "olmo2"}  # HF model_type -> our backbone name


@dataclass
class ConversionReport:
    out_dir: Path
    backbone: str
    backbone_source: str
    dtype: str
    num_tensors: int
    bytes_written: int
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- 1. config.yaml and the token layout ---------------------------------------------------------


def check_token_layout(conf: dict[str, Any], source: str) -> vocab.VocabLayout:
    """token_bias ranges and special-token names must be engine/vocab.py's; returns the layout."""
    tokens = conf.get("token_list")
    bias = conf.get("token_bias")
    if not isinstance(tokens, list) or not isinstance(bias, dict):
        raise ConversionError(f"{source}: needs token_list and token_bias (is this an OpusLM config?)")
    corelm = conf.get("corelm", "ar_delay")
    if corelm != "ar_delay":
        raise ConversionError(f"{source}: corelm {corelm!r} is not supported (the engine runs ar_delay)")
    nq = conf.get("codec_token_per_frame", vocab.NUM_STREAMS)
    if nq != vocab.NUM_STREAMS:
        raise ConversionError(f"{source}: codec_token_per_frame {nq}, the engine needs {vocab.NUM_STREAMS}")
    want = {
        "special_token": (0, vocab.NUM_SPECIALS),
        "ssl": (vocab.SSL_OFFSET, vocab.SSL_OFFSET + vocab.SSL_SIZE),
        "codec": (vocab.DAC_OFFSET, vocab.TEXT_OFFSET),
    }
    for block, (lo, hi) in want.items():
        if block not in bias:
            if block == "special_token":
                continue
            raise ConversionError(f"{source}: token_bias has no {block!r} block")
        if tuple(bias[block]) != (lo, hi):
            raise ConversionError(f"{source}: token_bias.{block} is {list(bias[block])}, engine/vocab.py has [{lo}, {hi}]")
    if "text_bpe" not in bias or int(bias["text_bpe"][0]) != vocab.TEXT_OFFSET:
        raise ConversionError(f"{source}: token_bias.text_bpe must start at {vocab.TEXT_OFFSET}, got {bias.get('text_bpe')}")
    text_size = int(bias["text_bpe"][1]) - vocab.TEXT_OFFSET
    for tid, names in SPECIAL_NAMES.items():
        got = tokens[tid] if tid < len(tokens) else None
        if got not in names:
            raise ConversionError(
                f"{source}: token_list[{tid}] is {got!r}, engine/vocab.py expects {' or '.join(names)}"
            )
    try:
        return vocab.VocabLayout(text_size=text_size, vocab_size=len(tokens))
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None


# ESPnet's defaults where the config omits a value: espnet2/tasks/speechlm.py::SpeechLMTask.add_task_arguments
# (jctian98/espnet@42e484b6; espnet/espnet@07efb0b2). A config.yaml ESPnet wrote holds every argument, so
# these apply only to hand-written ones.
ESPNET_SPEAKER_PROMPT_LENGTH = 150
ESPNET_PAD_SPEAKER_PROMPT = True


def read_prompt_layout(conf: dict[str, Any], source: str) -> tuple[PromptLayout, list[str]]:
    """The layout values ESPnet's preprocessor reads from config.yaml (engine/layout.py), and notes.

    ESPnet (espnet2/tasks/speechlm.py::SpeechLMTask.build_preprocess_fn -> espnet2/train/preprocessor.py::
    SpeechLMPreprocessor): `speaker_prompt_length` and `pad_speaker_prompt` size the speaker prompt;
    `codec_token_in_use` is the number of streams every row has (ARDelayLM's `nq`, and
    `inter_segment_pad` = codec_token_in_use - 1); `audio_modality` picks the id offset of the speaker
    prompt's stream 0; `encoder_decoder_format` splits the sequence in two. The engine serves 9 streams
    (its delay pattern, aux heads and codec all have 8 codebooks), codec_ssl audio and one decoder-only
    sequence, so any other value of those three is refused here rather than served as a layout the
    weights never saw.
    """
    notes: list[str] = []
    per_frame = conf.get("codec_token_per_frame", vocab.NUM_STREAMS)
    in_use = conf.get("codec_token_in_use")
    if in_use is None:  # the preprocessor's rule: all of them
        in_use = per_frame
    if isinstance(in_use, bool) or not isinstance(in_use, int) or in_use != vocab.NUM_STREAMS:
        raise ConversionError(
            f"{source}: codec_token_in_use is {in_use!r}, the engine serves exactly {vocab.NUM_STREAMS} streams per "
            f"frame (SSL + {vocab.NUM_CODEBOOKS} codebooks): a model trained on another number of streams (rows of "
            "that width, that many minus one pad rows between segments) cannot be served"
        )
    modality = conf.get("audio_modality", "codec_ssl")
    if modality != "codec_ssl":
        raise ConversionError(f"{source}: audio_modality {modality!r} is not supported (the engine serves codec_ssl)")
    if conf.get("encoder_decoder_format", False):
        raise ConversionError(f"{source}: encoder_decoder_format true is not supported (the engine runs decoder-only)")
    length = conf.get("speaker_prompt_length")
    if length is None:
        length = ESPNET_SPEAKER_PROMPT_LENGTH
        notes.append(f"speaker_prompt_length not in config.yaml: ESPnet's default {length}")
    pad = conf.get("pad_speaker_prompt")
    if pad is None:
        pad = ESPNET_PAD_SPEAKER_PROMPT
    try:
        layout = PromptLayout(speaker_prompt_length=length, pad_speaker_prompt=pad)
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    notes.append(f"prompt layout: speaker_prompt_length {layout.speaker_prompt_length}, "
                 f"pad_speaker_prompt {str(layout.pad_speaker_prompt).lower()}")
    return layout, notes


# --- 2. the backbone's configuration -------------------------------------------------------------


def read_backbone_config(
    src_dir: Path, conf: dict[str, Any], override: Path | None, hf_cache_dir: Path | None = None
) -> tuple[dict[str, Any], str]:
    """(HF config.json of the backbone, where it came from)."""
    import json

    if override is not None:
        path = Path(override)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConversionError(f"--backbone-config {override}: no such file")
    else:
        tconf = conf.get("transformer_conf") or {}
        tag = tconf.get("hf_model_tag")
        if not tag:
            raise ConversionError("config.yaml has no transformer_conf.hf_model_tag; pass --backbone-config PATH")
        found = hub.find_file(str(tag), "config.json", src_dir, tconf.get("revision"), hf_cache_dir)
        if found is None:
            raise ConversionError(
                f"backbone config for {tag!r} not found: not a local directory (relative paths are "
                f"relative to {src_dir}) and not in the local Hugging Face cache; download it or "
                "pass --backbone-config PATH"
            )
        path = found
    try:
        return json.loads(path.read_text()), str(path)
    except ValueError:
        raise ConversionError(f"{path}: not valid JSON") from None


def opuslm_config(
    bb: dict[str, Any], conf: dict[str, Any], layout: vocab.VocabLayout, torch_dtype: str, source: str,
    prompt: PromptLayout | None = None,
) -> checkpoint.OpusLMConfig:
    model_type = bb.get("model_type")
    if model_type not in _BACKBONES:
        raise ConversionError(
            f"{source}: unknown backbone model_type {model_type!r}; supported: {sorted(_BACKBONES)}"
        )
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if bb.get(key, want) != want:
            raise ConversionError(f"{source}: {key}={bb[key]!r} is not supported (need {want!r})")
    rope = bb.get("rope_parameters") or {}
    scaling = bb.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ConversionError(f"{source}: RoPE scaling {scaling!r} is not supported")
    heads = int(bb["num_attention_heads"])
    if bb.get("head_dim") not in (None, int(bb["hidden_size"]) // heads):
        raise ConversionError(f"{source}: head_dim {bb['head_dim']} != hidden_size / num_attention_heads")
    n_ctx = (conf.get("transformer_conf") or {}).get("n_ctx")
    try:
        return checkpoint.OpusLMConfig(
            hidden_size=int(bb["hidden_size"]),
            intermediate_size=int(bb["intermediate_size"]),
            num_hidden_layers=int(bb["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(bb.get("num_key_value_heads") or heads),
            vocab_size=layout.vocab_size,
            text_size=layout.text_size,
            max_position_embeddings=int(n_ctx or bb["max_position_embeddings"]),
            rms_norm_eps=float(bb["rms_norm_eps"]),
            rope_theta=float(bb.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            backbone=_BACKBONES[model_type],
            torch_dtype=torch_dtype,
            speaker_prompt_length=(prompt or PromptLayout()).speaker_prompt_length,
            pad_speaker_prompt=(prompt or PromptLayout()).pad_speaker_prompt,
        )
    except KeyError as e:
        raise ConversionError(f"{source}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None


# --- 3. the weights -------------------------------------------------------------------------------


def find_weights(src_dir: Path) -> Path:
    """`model.pth`, else the one `*.pth` in the directory (ESPnet's `Nepoch.pth`, averaged models)."""
    if (src_dir / "model.pth").is_file():
        return src_dir / "model.pth"
    found = sorted(p for p in src_dir.glob("*.pth") if p.name != "checkpoint.pth")
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConversionError(f"no model.pth or *epoch.pth in {src_dir}")
    raise ConversionError(f"several weight files in {src_dir} ({', '.join(p.name for p in found)}); keep one")


def map_lm_key(name: str) -> str | None:
    """ESPnet name -> ours; None when dropped. Raises ConversionError on anything unknown."""
    if name in _EXACT:
        return _EXACT[name]
    if name.startswith(_DROP):
        return None
    if name.startswith(_DECODER):
        return "model." + name[len(_DECODER) :]
    raise ConversionError(f"unexpected checkpoint key {name!r}: no mapping rule (refusing to drop weights silently)")


def _check_inv_freq(name: str, t: torch.Tensor, cfg: checkpoint.OpusLMConfig) -> None:
    d = cfg.head_dim
    want = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if tuple(t.shape) != tuple(want.shape) or not torch.allclose(t.double(), want, rtol=1e-2):
        raise ConversionError(f"{name} does not match rope_theta={cfg.rope_theta} of the backbone config")


def plan_tensors(
    state: dict[str, torch.Tensor], cfg: checkpoint.OpusLMConfig, share_emb: bool
) -> tuple[dict[str, str], list[str]]:
    """({our name: ESPnet name}, dropped ESPnet names) after checking names and shapes."""
    expected = checkpoint.expected_weight_shapes(cfg)
    sources: dict[str, str] = {}
    dropped: list[str] = []
    for name, t in state.items():
        if name.startswith(_DECODER) and name.endswith(_INV_FREQ):
            _check_inv_freq(name, t, cfg)
            dropped.append(name)
            continue
        ours = map_lm_key(name)
        if ours is None:
            dropped.append(name)
            continue
        if ours not in expected:
            raise ConversionError(f"unexpected checkpoint key {name!r} (-> {ours!r}): not part of a {cfg.backbone} OpusLM")
        if ours in sources:
            raise ConversionError(f"{sources[ours]!r} and {name!r} both map to {ours!r}")
        if tuple(t.shape) != expected[ours]:
            raise ConversionError(f"{name!r} has shape {tuple(t.shape)}, expected {expected[ours]} for {ours!r}")
        if not t.is_floating_point():
            raise ConversionError(f"{name!r} has dtype {t.dtype}, expected a float tensor")
        sources[ours] = name
    if share_emb and "lm_head.weight" not in sources and "model.embed_tokens.weight" in sources:
        sources["lm_head.weight"] = sources["model.embed_tokens.weight"]  # corelm_conf.share_emb
    missing = [n for n in expected if n not in sources]
    if missing:
        espnet = {v: k for k, v in _EXACT.items()}.get(missing[0]) or _DECODER + missing[0][len("model.") :]
        raise ConversionError(f"checkpoint is missing {espnet!r} ({len(missing)} tensors missing)")
    return sources, dropped


# --- 4. writing --------------------------------------------------------------------------------


def convert_espnet(
    src_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "bf16",
    backbone_config: str | Path | None = None,
    codec_dir: str | Path | None = None,
    hf_cache_dir: str | Path | None = None,
    xeus_dir: str | Path | None = None,
    xeus_layer: int = 18,
) -> ConversionReport:
    """Convert; see the module docstring. `out_dir` is created (it may exist if empty)."""
    src, out = Path(src_dir), Path(out_dir)
    if xeus_dir is not None and not Path(xeus_dir).is_dir():
        raise ConversionError(f"--xeus {xeus_dir} is not a directory")
    xeus = Path(xeus_dir) if xeus_dir else (src / "xeus" if (src / "xeus").is_dir() else None)
    if xeus is not None:
        xeus_inputs(xeus)  # before anything is written (the contents are checked later)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not src.is_dir():
        raise ConversionError(f"{src} is not a directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out} exists and is not an empty directory")
    conf = read_yaml(src / "config.yaml")
    layout = check_token_layout(conf, str(src / "config.yaml"))
    prompt_layout, layout_notes = read_prompt_layout(conf, str(src / "config.yaml"))
    bb, bb_source = read_backbone_config(src, conf, Path(backbone_config) if backbone_config else None,
                                         Path(hf_cache_dir) if hf_cache_dir else None)
    out_dtype, dtype_name = DTYPES[dtype]
    cfg = opuslm_config(bb, conf, layout, dtype_name, bb_source, prompt_layout)
    weights = find_weights(src)
    state = load_state(weights)
    share_emb = bool((conf.get("corelm_conf") or {}).get("share_emb", False))
    sources, dropped = plan_tensors(state, cfg, share_emb)
    codec_src = Path(codec_dir) if codec_dir else (src / "codec" if (src / "codec").is_dir() else None)
    tokenizer_files, tokenizer_note = find_tokenizer(src, conf, layout, Path(hf_cache_dir) if hf_cache_dir else None)
    codec = None
    if codec_src is not None:
        codec_conf = read_yaml(codec_src / "config.yaml")
        codec = prepare_codec(load_state(find_weights(codec_src)), codec_conf, str(codec_src))

    out.mkdir(parents=True, exist_ok=True)
    shapes = checkpoint.expected_weight_shapes(cfg)
    names = sorted(sources)
    nbytes = write_safetensors(
        checkpoint.weights_path(out),
        [(n, functools.partial(state.__getitem__, sources[n])) for n in names],
        shapes,
        out_dtype,
        PageDropper(weights),
    )
    del state
    checkpoint.save_config(cfg, out)
    shutil.copyfile(src / "config.yaml", out / "espnet_config.yaml")
    report = ConversionReport(out, cfg.backbone, bb_source, dtype_name, len(names), nbytes, dropped)
    report.notes += layout_notes
    if tokenizer_files:
        (out / TOKENIZER_SUBDIR).mkdir()
        for name, path in tokenizer_files.items():
            shutil.copyfile(path, out / TOKENIZER_SUBDIR / name)
    report.notes.append(tokenizer_note)
    if codec is not None:
        write_codec(*codec, out)
        report.notes.append(f"codec: {len(codec[1])} tensors from {codec_src} -> codec/")
    else:
        report.notes.append("no codec/ in the source: codec/ not written (the LM alone still loads)")
    report.notes += _ssl_notes(src, out, xeus, xeus_layer)
    return report


def find_tokenizer(
    src: Path, conf: dict[str, Any], layout: vocab.VocabLayout, cache: Path | None
) -> tuple[dict[str, Path], str]:
    """The text tokenizer's local files ({} if none) named by `subword_model`, else by
    `transformer_conf.hf_model_tag` (they differ for the dialogue model), and a note."""
    tconf = conf.get("transformer_conf") or {}
    tag = conf.get("subword_model") or tconf.get("hf_model_tag")
    if not tag:
        return {}, "no subword_model / hf_model_tag: no text tokenizer written"
    found = {f: hub.find_file(str(tag), f, src, None, cache) for f in hub.TOKENIZER_FILES}
    if found["tokenizer.json"] is None:
        return {}, f"text tokenizer {tag!r} not found locally (no tokenizer.json): no text tokenizer written"
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(found["tokenizer.json"])).get_vocab_size(with_added_tokens=True)
    if size > layout.text_size:
        raise ConversionError(
            f"text tokenizer {tag!r} has {size} ids but the model's text range holds {layout.text_size}"
        )
    files = {name: path for name, path in found.items() if path is not None}
    return files, f"text tokenizer: {tag!r} ({size} ids) -> {TOKENIZER_SUBDIR}/"


def _ssl_notes(src: Path, out: Path, xeus: Path | None, xeus_layer: int) -> list[str]:
    """The stream-0 tokenizer: XEUS + k-means converted (engine/convert/xeus.py) from `xeus`
    (`--xeus` or `src/xeus`), else our-format `src/ssl/` copied, else a note saying how to add it."""
    if xeus is not None:
        report = convert_xeus(xeus, out, output_layer=xeus_layer)
        return [
            f"ssl: XEUS from {xeus} ({report.config.num_blocks} blocks, layer {report.config.output_layer}) "
            "+ k-means -> ssl/",
            *report.notes,
        ]
    ssl = src / "ssl"
    if (ssl / "config.json").is_file() and (ssl / "model.safetensors").is_file():
        shutil.copytree(ssl, out / "ssl")
        return ["ssl: copied ssl/ (already in engine/codec format)"]
    return [
        "ssl/ not written: no xeus/ in the source; audio input needs it: "
        f"duplex convert xeus XEUS_DIR {out} (XEUS_DIR = a snapshot of espnet/xeus)"
    ]


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    i = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**i:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][i]}"
