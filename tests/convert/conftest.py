"""Helpers for tests/convert, reached through the `espnet_layout` fixture (this module).

A tiny OpusLM checkpoint written in ESPnet's own layout, and ESPnet's forward computed from it.

The layout follows ESPnet's code (not installed here): `ESPnetSpeechLMModel.corelm` is an
`ARDelayLM` (`core_lm/ar_parallel.py`): `emb` = Embedding(V, H, padding_idx=0), `lm_head` =
Linear(H, V), `head_emb` = Embedding(12, H) with row 0 zero, and `decoders` =
`HFTransformerDecoder` whose `.model` is the HF *base* model with its input embedding removed
(`module/huggingface.py`). So the state dict holds `corelm.emb.weight`, `corelm.lm_head.weight`,
`corelm.head_emb.weight`, `corelm.decoders.model.<HF LlamaModel / Olmo2Model names>` and
training-only `criterion.*`. `config.yaml` carries `token_list`, `token_bias`,
`codec_token_per_frame` and `transformer_conf.hf_model_tag` (here a local dir, relative to the
experiment dir, with the backbone's HF config.json).

`espnet_greedy` is the independent oracle: the HF backbone (exactly what ESPnet runs) on the
sum of the 9 streams' embeddings, stream k's logits = lm_head(h + head_emb[k]), greedy within
each stream's range, with the engine's delay/flush schedule for a fixed number of frames.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from engine import vocab

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 2, 4, 2, 256
TEXT_SIZE = 64
EXTRA_IDS = 3  # the released vocabularies have ids above the text range too
N_CTX = 512
_EMB_STD, _HEAD_STD, _LAYER_STD = 0.5, 0.25, 0.08  # peaked logits: no near-ties in greedy

_NAMED = {
    0: "<pad>", 1: "<unk>", 2: "<blank>", 3: "<space>", 4: "<continuous_placeholder>",
    5: "<sos/eos>", 6: "<local_sos/eos>", 7: "<unkown_task_identifer>", 8: "<system_prompt>",
    9: "<user_input>", 10: "<assistant_output>", 11: "<eou>", 32: "<codec_start/end>",
    33: "<ssl_start/end>", 34: "<codec_ssl_start/end>", 35: "<text_bpe_start/end>",
    36: "<g2p_start/end>", 37: "<spk_start/end>", 64: "<textlm_task>", 80: "<codec_ssl_asr_task>",
    81: "<codec_ssl_tts_task>", 82: "<codec_ssl_plain_tts_task>", 83: "<codec_ssl_audiolm_task>",
    88: "<text_dialogue_task>", 89: "<audio_dialogue_task>",
}


def token_list(text_tokens: list[str] | None = None) -> list[str]:
    toks = [_NAMED.get(i, f"<unused_token_{i}>") for i in range(vocab.NUM_SPECIALS)]
    toks += [f"<ssl_{i}>" for i in range(vocab.SSL_SIZE)]
    toks += [f"<codec_layer{k}_code{c}>" for k in range(vocab.NUM_CODEBOOKS) for c in range(vocab.CODEBOOK_SIZE)]
    text = list(text_tokens or [])[:TEXT_SIZE]
    toks += text + [f"<text_{i}>" for i in range(len(text), TEXT_SIZE)]
    toks += [f"<extra_{i}>" for i in range(EXTRA_IDS)]
    return toks


def hf_config(backbone: str):
    from transformers import LlamaConfig, Olmo2Config

    common = dict(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=2048, vocab_size=TEXT_SIZE,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if backbone == "olmo2":
        return Olmo2Config(rms_norm_eps=1e-6, rope_theta=500000.0, **common)
    return LlamaConfig(rms_norm_eps=1e-5, rope_theta=130000.0, mlp_bias=False, **common)


def hf_backbone(backbone: str) -> torch.nn.Module:
    from transformers import AutoModel

    cfg = hf_config(backbone)
    cfg._attn_implementation = "eager"
    return AutoModel.from_config(cfg).eval()


def espnet_state_dict(backbone: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    v = vocab.TEXT_OFFSET + TEXT_SIZE + EXTRA_IDS
    body = hf_backbone(backbone).state_dict()
    sd: dict[str, torch.Tensor] = {}
    emb = _EMB_STD * torch.randn(v, HIDDEN, generator=gen)
    emb[0] = 0.0  # padding_idx=0
    sd["corelm.emb.weight"] = emb
    for name in sorted(body):
        if name.startswith("embed_tokens."):
            continue  # HFTransformerDecoder.init_embeddings: set_input_embeddings(None)
        shape = body[name].shape
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = _LAYER_STD * torch.randn(shape, generator=gen)
        sd["corelm.decoders.model." + name] = t
    sd["corelm.lm_head.weight"] = _HEAD_STD * torch.randn(v, HIDDEN, generator=gen)
    head = _HEAD_STD * torch.randn(12, HIDDEN, generator=gen)
    head[0] = 0.0
    sd["corelm.head_emb.weight"] = head
    sd["criterion.ce_loss.weight"] = torch.ones(v)  # a training-only module's state
    return sd


def write_espnet_checkpoint(
    exp_dir: Path,
    backbone: str,
    seed: int = 0,
    text_tokens: list[str] | None = None,
    deepspeed: bool = False,
    weights_name: str = "model.pth",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Write `exp_dir/{config.yaml, model.pth, backbone/config.json}`; returns the state dict."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    (exp_dir / "backbone").mkdir(exist_ok=True)
    (exp_dir / "backbone" / "config.json").write_text(hf_config(backbone).to_json_string())
    text_end = vocab.TEXT_OFFSET + TEXT_SIZE
    conf = {
        "token_list": token_list(text_tokens),
        "token_bias": {
            "special_token": [0, vocab.NUM_SPECIALS],
            "ssl": [vocab.SSL_OFFSET, vocab.DAC_OFFSET],
            "codec": [vocab.DAC_OFFSET, vocab.TEXT_OFFSET],
            "text_bpe": [vocab.TEXT_OFFSET, text_end],
        },
        "codec_token_per_frame": vocab.NUM_STREAMS,
        "corelm": "ar_delay",
        "corelm_conf": {"share_emb": False},
        "transformer_conf": {"hf_model_tag": "backbone", "n_ctx": N_CTX, "dtype": "bfloat16"},
        "speaker_prompt_length": 500,  # the layout values ESPnet's preprocessor reads (engine/layout.py)
        "pad_speaker_prompt": True,
        "codec_token_in_use": vocab.NUM_STREAMS,
    }
    (exp_dir / "config.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))
    sd = {k: v.to(dtype) for k, v in espnet_state_dict(backbone, seed).items()}
    torch.save({"module": sd} if deepspeed else sd, exp_dir / weights_name)
    return sd


class EspnetOracle:
    """ESPnet's forward over the ESPnet-layout tensors (float32), through the HF backbone."""

    def __init__(self, backbone: str, sd: dict[str, torch.Tensor]) -> None:
        self.model = hf_backbone(backbone)
        body = {k[len("corelm.decoders.model.") :]: v.float() for k, v in sd.items() if k.startswith("corelm.decoders.model.")}
        missing, unexpected = self.model.load_state_dict(body, strict=False)
        assert not unexpected and all(m.startswith("embed_tokens.") for m in missing), (missing, unexpected)
        self.emb = sd["corelm.emb.weight"].float()
        self.lm_head = sd["corelm.lm_head.weight"].float()
        self.head_emb = sd["corelm.head_emb.weight"].float()

    @torch.no_grad()
    def logits(self, rows: np.ndarray) -> torch.Tensor:
        """Rows [L, 9] -> the last position's logits of every stream [9, V]."""
        x = self.emb[torch.from_numpy(np.asarray(rows, dtype=np.int64))].sum(dim=1)  # summed embeddings
        h = self.model(inputs_embeds=x[None]).last_hidden_state[0, -1]
        return (h[None, :] + self.head_emb[: vocab.NUM_STREAMS]) @ self.lm_head.t()

    def greedy(self, prompt: np.ndarray, frames: int) -> np.ndarray:
        """Steps [frames + 8, 9]: stream 0 argmax over SSL for `frames` steps, then EOS, the
        flush pads and the engine's stop id; stream k argmax over its codebook while it carries a
        frame (step s carries frame s - k), PAD otherwise."""
        rows = [np.asarray(r) for r in prompt]
        steps = []
        ssl_lo, ssl_hi = vocab.stream_range(0)
        for s in range(frames + vocab.NUM_STREAMS - 1):
            logits = self.logits(np.stack(rows))
            if s < frames:
                tok0 = ssl_lo + int(logits[0, ssl_lo:ssl_hi].argmax())
            elif s == frames:
                tok0 = vocab.SOS_EOS
            elif s < frames + vocab.NUM_CODEBOOKS - 1:
                tok0 = vocab.PAD
            else:
                tok0 = vocab.ENGINE_STOP
            row = [tok0]
            for k in range(1, vocab.NUM_STREAMS):
                lo, hi = vocab.stream_range(k)
                row.append(lo + int(logits[k, lo:hi].argmax()) if 0 <= s - k < frames else vocab.PAD)
            steps.append(np.array(row, dtype=np.int64))
            rows.append(steps[-1])
        return np.stack(steps)


FRAMES = (6, 11, 9)  # per parity request; min = max, so stream 0's EOS step is fixed


def convert_tiny(tmp: Path, backbone: str, seed: int) -> tuple[Path, EspnetOracle]:
    from engine.convert import convert_espnet

    sd = write_espnet_checkpoint(tmp / "exp", backbone, seed=seed, deepspeed=backbone == "olmo2")
    convert_espnet(tmp / "exp", tmp / "out", dtype="fp32")
    return tmp / "out", EspnetOracle(backbone, sd)


def parity_requests() -> list:
    from engine.prompt import synthetic_prompt
    from engine.request import AudioRequest
    from engine.sampling import GREEDY

    return [AudioRequest(synthetic_prompt(i, 10 + 3 * i), f, f, GREEDY) for i, f in enumerate(FRAMES)]


def check_reference(model_dir: Path, oracle: EspnetOracle) -> None:
    from engine.reference import ReferenceOpusLM

    ref = ReferenceOpusLM.from_dir(model_dir)
    for i, req in enumerate(parity_requests()):
        want = oracle.greedy(req.prompt, req.max_frames)
        got = ref.generate(req).steps
        assert np.array_equal(got, want), f"request {i}: reference != ESPnet forward"


def check_vllm(model_dir: Path, loop_thread, oracle: EspnetOracle) -> None:
    """One vLLM engine on the converted checkpoint; concurrent greedy requests == ESPnet."""
    from engine.async_engine import AsyncOpusEngine, EngineConfig

    engine = loop_thread.run(AsyncOpusEngine.start(EngineConfig(model=str(model_dir), max_num_seqs=4)))
    reqs = parity_requests()

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    try:
        gens = loop_thread.run(run())
    finally:
        engine.shutdown()
    for i, (req, gen) in enumerate(zip(reqs, gens)):
        want = oracle.greedy(req.prompt, req.max_frames)
        assert np.array_equal(gen.steps, want), f"request {i}: vLLM != ESPnet forward"


@pytest.fixture(scope="session")
def espnet_layout():
    """This module: the ESPnet-layout writer, ESPnet's forward and the parity checks."""
    return sys.modules[__name__]
