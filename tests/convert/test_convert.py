"""The ESPnet converter without vLLM: refusals (each names what is wrong), the CLI, dtypes, the
backbone config from a local Hugging Face cache, the codec rename and the text tokenizer."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine import delay, vocab
from engine.checkpoint import OpusLMConfig, load_config
from engine.cli import main as cli_main
from engine.convert import ConversionError, convert_espnet
from engine.text import NoTextTokenizerError, TextTokenizer

TEXT_SIZE = 64  # tests/convert/conftest.py
SENTENCES = ["hello there how are you", "i am fine thank you", "what is the weather like today"]


@pytest.fixture(scope="module")
def base_exp(tmp_path_factory, espnet_layout) -> Path:
    assert espnet_layout.TEXT_SIZE == TEXT_SIZE
    exp = tmp_path_factory.mktemp("espnet") / "exp"
    espnet_layout.write_espnet_checkpoint(exp, "llama", seed=5)
    return exp


@pytest.fixture
def exp(base_exp, tmp_path) -> Path:
    dst = tmp_path / "exp"
    shutil.copytree(base_exp, dst)
    return dst


def _edit_state(exp: Path, fn) -> None:
    sd = torch.load(exp / "model.pth", weights_only=True)
    fn(sd)
    torch.save(sd, exp / "model.pth")


def _edit_conf(exp: Path, **values) -> None:
    """Set (value) or remove (None) top-level fields of the experiment's config.yaml."""
    conf = yaml.safe_load((exp / "config.yaml").read_text())
    for key, value in values.items():
        if value is None:
            conf.pop(key, None)
        else:
            conf[key] = value
    (exp / "config.yaml").write_text(yaml.safe_dump(conf))


def _refusal(exp: Path, tmp_path: Path, match: str) -> None:
    with pytest.raises(ConversionError, match=match):
        convert_espnet(exp, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --- refusals ------------------------------------------------------------------------------------


def test_refuses_missing_tensor(exp, tmp_path) -> None:
    _edit_state(exp, lambda sd: sd.pop("corelm.decoders.model.layers.1.mlp.up_proj.weight"))
    _refusal(exp, tmp_path, r"missing 'corelm\.decoders\.model\.layers\.1\.mlp\.up_proj\.weight'")


def test_refuses_wrong_shape(exp, tmp_path) -> None:
    def cut(sd):
        sd["corelm.head_emb.weight"] = sd["corelm.head_emb.weight"][:9]

    _edit_state(exp, cut)
    _refusal(exp, tmp_path, r"'corelm\.head_emb\.weight' has shape \(9, 128\), expected \(12, 128\)")


@pytest.mark.parametrize("key", ["corelm.aux_lm_head.weight", "reflm.emb.weight", "corelm.decoders.model.layers.0.extra.weight"])
def test_refuses_unknown_key(exp, tmp_path, key) -> None:
    _edit_state(exp, lambda sd: sd.__setitem__(key, torch.zeros(3)))
    _refusal(exp, tmp_path, rf"unexpected checkpoint key '{key}'")


def test_refuses_unknown_backbone(exp, tmp_path, espnet_layout) -> None:
    cfg = espnet_layout.hf_config("llama").to_dict() | {"model_type": "qwen2"}
    (exp / "backbone" / "config.json").write_text(__import__("json").dumps(cfg))
    _refusal(exp, tmp_path, r"unknown backbone model_type 'qwen2'")


def test_refuses_token_list_mismatch(exp, tmp_path) -> None:
    conf = yaml.safe_load((exp / "config.yaml").read_text())
    conf["token_list"][vocab.TEXT_BPE], conf["token_list"][vocab.CODEC_SSL] = (
        conf["token_list"][vocab.CODEC_SSL],
        conf["token_list"][vocab.TEXT_BPE],
    )
    (exp / "config.yaml").write_text(yaml.safe_dump(conf))
    _refusal(exp, tmp_path, r"token_list\[34\] is '<text_bpe_start/end>', engine/vocab.py expects <codec_ssl_start/end>")


def test_refuses_missing_backbone_config(exp, tmp_path) -> None:
    shutil.rmtree(exp / "backbone")
    _refusal(exp, tmp_path, r"backbone config for 'backbone' not found.*--backbone-config")


# --- the layout values of config.yaml (engine/layout.py) -----------------------------------------


def test_a_speaker_prompt_length_of_150_is_carried_and_lays_out_150_frames(exp, tmp_path) -> None:
    from engine.dialogue import DialogueTurn, fit_context, response_prompt
    from engine.prompt import random_frames

    _edit_conf(exp, speaker_prompt_length=150)
    report = convert_espnet(exp, tmp_path / "out")
    assert "prompt layout: speaker_prompt_length 150, pad_speaker_prompt true" in report.notes
    cfg = load_config(tmp_path / "out")
    assert (cfg.speaker_prompt_length, cfg.pad_speaker_prompt) == (150, True)
    # the prompt the engine builds from that config (engine/service.py passes cfg.prompt_layout)
    rng = np.random.default_rng(0)
    voice, user = random_frames(rng, 40), random_frames(rng, 12)
    prompt = response_prompt([DialogueTurn(vocab.USER, user)], voice, layout=cfg.prompt_layout)
    padded = np.concatenate([voice, np.full((110, 9), vocab.PAD, np.int64)])  # 150 frames
    np.testing.assert_array_equal(prompt[:4, 0], [vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE, vocab.SYSTEM, vocab.SPEAKER])
    np.testing.assert_array_equal(prompt[4 : 4 + 158], delay.interleave(padded))
    np.testing.assert_array_equal(prompt[162:164, 0], [vocab.USER, vocab.CODEC_SSL])  # the user turn follows
    assert len(prompt) == 2 + (2 + 150 + 8) + (2 + 12 + 8) + 2
    fit = fit_context([], 12, 1 << 20, 10, 1.0, speaker_frames=40, layout=cfg.prompt_layout)
    assert fit.prompt_rows == len(prompt)


def test_pad_speaker_prompt_false_is_carried_and_a_missing_length_is_espnets_default(exp, tmp_path) -> None:
    _edit_conf(exp, speaker_prompt_length=None, pad_speaker_prompt=False)
    report = convert_espnet(exp, tmp_path / "out")
    cfg = load_config(tmp_path / "out")
    assert (cfg.speaker_prompt_length, cfg.pad_speaker_prompt) == (150, False)  # espnet2/tasks/speechlm.py default
    assert "speaker_prompt_length not in config.yaml: ESPnet's default 150" in report.notes
    assert cfg.prompt_layout.speaker_frames(np.zeros((40, 9), np.int64)).shape == (40, 9)  # not padded


def test_a_missing_codec_token_in_use_means_every_stream(exp, tmp_path) -> None:
    _edit_conf(exp, codec_token_in_use=None)  # the preprocessor: codec_token_per_frame
    convert_espnet(exp, tmp_path / "out")
    assert load_config(tmp_path / "out").num_streams == vocab.NUM_STREAMS


@pytest.mark.parametrize("value", [5, 8, 10, "9"])
def test_refuses_a_codec_token_in_use_the_engine_cannot_serve(exp, tmp_path, value) -> None:
    _edit_conf(exp, codec_token_in_use=value)
    _refusal(exp, tmp_path, rf"codec_token_in_use is {value!r}, the engine serves exactly 9 streams per frame")


@pytest.mark.parametrize("field, value, match", [
    ("speaker_prompt_length", 0, r"speaker_prompt_length must be >= 1, got 0"),
    ("speaker_prompt_length", "long", r"speaker_prompt_length must be an int, got 'long'"),
    ("pad_speaker_prompt", "sometimes", r"pad_speaker_prompt must be true or false"),
    ("audio_modality", "codec", r"audio_modality 'codec' is not supported"),
    ("encoder_decoder_format", True, r"encoder_decoder_format true is not supported"),
])
def test_refuses_layout_values_it_cannot_serve(exp, tmp_path, field, value, match) -> None:
    _edit_conf(exp, **{field: value})
    _refusal(exp, tmp_path, match)


def test_cli_refuses_codec_token_in_use_naming_the_field(exp, tmp_path, capsys) -> None:
    _edit_conf(exp, codec_token_in_use=5)
    assert cli_main(["convert", "espnet", str(exp), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("duplex convert: error: ") and "codec_token_in_use is 5" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_written_before_the_layout_values_reads_the_defaults(tmp_path, tiny_model) -> None:
    import json

    d = json.loads((tiny_model / "config.json").read_text())
    assert d["opuslm"]["speaker_prompt_length"] == 500 and d["opuslm"]["pad_speaker_prompt"] is True  # the tiny model's
    for key in ("speaker_prompt_length", "pad_speaker_prompt"):
        del d["opuslm"][key]
    cfg = OpusLMConfig.from_hf_dict(d)
    assert (cfg.speaker_prompt_length, cfg.pad_speaker_prompt, cfg.extra) == (500, True, {})
    d["opuslm"]["speaker_prompt_length"] = 0
    with pytest.raises(ValueError, match="speaker_prompt_length"):
        OpusLMConfig.from_hf_dict(d)


# --- CLI and outputs -----------------------------------------------------------------------------


def test_cli_bad_input_exit_2_one_line(exp, tmp_path, capsys) -> None:
    _edit_state(exp, lambda sd: sd.__setitem__("corelm.unknown", torch.zeros(1)))
    assert cli_main(["convert", "espnet", str(exp), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("duplex convert: error: unexpected checkpoint key 'corelm.unknown'")
    assert "\n" not in err and "Traceback" not in err
    assert cli_main(["convert", "espnet", str(tmp_path / "nope"), str(tmp_path / "out2")]) == 2


def test_cli_bf16_epoch_file_and_backbone_override(exp, tmp_path, capsys) -> None:
    (exp / "model.pth").rename(exp / "2epoch.pth")
    bb = tmp_path / "elsewhere"
    shutil.move(exp / "backbone", bb)
    out = tmp_path / "out"
    rc = cli_main(["convert", "espnet", str(exp), str(out), "--backbone-config", str(bb / "config.json")])
    assert rc == 0, capsys.readouterr().err
    assert "llama backbone" in capsys.readouterr().out
    tensors = load_file(str(out / "model.safetensors"))
    src = torch.load(exp / "2epoch.pth", weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"],
                       src["corelm.decoders.model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))
    cfg = load_config(out)
    assert (cfg.backbone, cfg.torch_dtype, cfg.text_size, cfg.rope_theta) == ("llama", "bfloat16", TEXT_SIZE, 130000.0)
    assert cfg.max_position_embeddings == 512  # transformer_conf.n_ctx
    assert cli_main(["convert", "espnet", str(exp), str(out)]) == 2  # out is not empty


def test_backbone_config_from_local_hf_cache(exp, tmp_path, espnet_layout) -> None:
    """A hub id in hf_model_tag resolves from the local Hugging Face cache only."""
    cache = tmp_path / "hub"
    snap = cache / "models--allenai--OLMo-2-tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(espnet_layout.hf_config("olmo2").to_json_string())
    (cache / "models--allenai--OLMo-2-tiny" / "refs").mkdir()
    (cache / "models--allenai--OLMo-2-tiny" / "refs" / "main").write_text("abc123")
    shutil.rmtree(exp)
    espnet_layout.write_espnet_checkpoint(exp, "olmo2", seed=6)
    conf = yaml.safe_load((exp / "config.yaml").read_text())
    conf["transformer_conf"]["hf_model_tag"] = "allenai/OLMo-2-tiny"
    (exp / "config.yaml").write_text(yaml.safe_dump(conf))
    report = convert_espnet(exp, tmp_path / "out", dtype="fp32", hf_cache_dir=cache)
    assert report.backbone == "olmo2" and report.backbone_source == str(snap / "config.json")
    assert load_config(tmp_path / "out").rms_norm_eps == 1e-6  # the backbone's own value
    with pytest.raises(ConversionError, match="not in the local Hugging Face cache"):
        convert_espnet(exp, tmp_path / "out2", hf_cache_dir=tmp_path / "empty")


# --- codec -----------------------------------------------------------------------------------------


def _espnet_codec(codec_dir: Path) -> dict[str, torch.Tensor]:
    """Our tiny DAC written under ESPnet's names: `codec.generator.` prefix, old-style weight norm
    on the decoder, EMA codebook state and a discriminator tensor to be dropped."""
    from engine.codec.dac import DAC
    from engine.codec.tiny import TINY_DAC

    torch.manual_seed(0)
    ours = DAC(TINY_DAC).state_dict()
    sd: dict[str, torch.Tensor] = {}
    for k, v in ours.items():
        name = k
        if k.startswith("decoder.") and "parametrizations.weight.original" in k:
            name = k.replace("parametrizations.weight.original0", "weight_g").replace(
                "parametrizations.weight.original1", "weight_v"
            )
        sd["codec.generator." + name] = v.clone()
        if k.endswith("_codebook.embed"):
            base = "codec.generator." + k[: -len("embed")]
            sd[base + "embed_avg"] = v.clone()
            sd[base + "cluster_size"] = torch.ones(v.shape[0])
            sd[base + "inited"] = torch.ones(1)
    sd["codec.discriminator.msmpmb.0.weight"] = torch.zeros(2, 2)
    codec_dir.mkdir(parents=True)
    gen = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(TINY_DAC).items()}
    sr = gen.pop("sample_rate_hz")
    gen |= {"encdec_activation": "Snake", "encdec_norm": "weight_norm", "encdec_causal": False}
    conf = {"codec": "dac", "codec_conf": {"sampling_rate": sr, "generator_params": gen}}
    (codec_dir / "config.yaml").write_text(yaml.safe_dump(conf))
    torch.save(sd, codec_dir / "360epoch.pth")
    return ours


def test_codec_rename_loads_into_dac(exp, tmp_path) -> None:
    from engine.codec.dac import DAC

    ours = _espnet_codec(exp / "codec")
    convert_espnet(exp, tmp_path / "out", dtype="fp32")
    got = DAC.from_dir(tmp_path / "out", fuse=False).state_dict()
    assert set(got) == set(ours)
    assert all(torch.equal(got[k], ours[k]) for k in ours)


def test_codec_refuses_snake_alpha(exp, tmp_path) -> None:
    _espnet_codec(exp / "codec")
    sd = torch.load(exp / "codec" / "360epoch.pth", weights_only=True)
    sd["codec.generator.decoder.model.1.alpha"] = torch.ones(1, 8, 1)
    torch.save(sd, exp / "codec" / "360epoch.pth")
    _refusal(exp, tmp_path, r"codec tensor 'codec\.generator\.decoder\.model\.1\.alpha'")


# --- text tokenizer ------------------------------------------------------------------------------


def _word_tokenizer(path: Path) -> list[str]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]


def test_text_tokenizer_written_and_shifted(exp, tmp_path) -> None:
    words = _word_tokenizer(exp / "backbone" / "tokenizer.json")
    convert_espnet(exp, tmp_path / "out", dtype="fp32")
    tok = TextTokenizer.from_dir(tmp_path / "out")
    ids = tok.encode("how is the weather")
    assert ids.dtype == np.int64 and tok.is_text(ids).all()
    assert list(ids - vocab.TEXT_OFFSET) == [words.index(w) for w in ("how", "is", "the", "weather")]
    assert tok.decode(ids) == "how is the weather"
    with pytest.raises(ValueError, match="not a text id"):
        tok.decode([vocab.SOS_EOS])
    with pytest.raises(ValueError, match="not a text id"):
        tok.decode([vocab.TEXT_OFFSET + TEXT_SIZE])


def test_tiny_model_has_a_deterministic_byte_level_bpe(tiny_model, tmp_path) -> None:
    from engine.tiny_text import make_tiny_text_tokenizer

    tok = TextTokenizer.from_dir(tiny_model)
    text = "Hello, how is the weather tomorrow? Ça va? 日本"  # beyond the corpus: bytes still cover it
    ids = tok.encode(text)
    assert len(ids) and tok.is_text(ids).all() and tok.decode(ids) == text
    assert len(tok.encode("Thank you for calling.")) < len("Thank you for calling.") / 2  # merges learnt
    # the same file on every build (the cache, CI and a user's machine agree on the ids)
    shipped = (tiny_model / "tokenizer" / "tokenizer.json").read_bytes()
    assert make_tiny_text_tokenizer(tmp_path, tok.text_size).read_bytes() == shipped


def test_a_model_without_tokenizer_files_says_so(tmp_path, tiny_model) -> None:
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("tokenizer"))
    with pytest.raises(NoTextTokenizerError, match="this model has no text tokenizer"):
        TextTokenizer.from_dir(model)
