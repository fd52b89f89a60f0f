"""estimate_memory on the transformers models people train, on the meta device: the checkpoint inputs
exact whatever transformers version puts its checkpoint call where, hybrid sliding/full-attention
models measured one block per kind (against measuring every block), the longest sequence of a
sliding-window model, dropout as a GPU keeps it, models with experts, vision-language and
encoder-decoder configs, and the loss the Python API and the command count."""
import json

import pytest
import torch

import ckpt_offload
import ckpt_offload.sizing.estimate as estimate
from ckpt_offload.sizing.estimate import estimate_memory

transformers = pytest.importorskip("transformers", reason="needs transformers for the model-config tests")

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=8192)


def meta_model(cfg, attn="sdpa", dtype=torch.float32):
    cfg._attn_implementation = attn
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def ids(batch, seq):
    return torch.empty(batch, seq, dtype=torch.long, device="meta")


def every_block(monkeypatch):
    """Makes estimate_memory measure every block (no representatives)."""
    monkeypatch.setattr(estimate, "_representatives",
                        lambda blocks, kinds=None: (list(range(len(blocks))), list(range(len(blocks)))))


# -- 1: the checkpoint inputs, whatever transformers version ---------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_inputs_are_layers_batch_seq_hidden_bytes(kind, attn, dtype):
    # transformers 5.16-5.18 call the checkpoint around the layer's __call__ (before its hooks run),
    # later ones inside its forward: the inputs are counted either way.
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config, "gemma": transformers.GemmaConfig}
    extra = {} if kind == "llama" else dict(head_dim=16)
    model = meta_model(cls[kind](num_hidden_layers=5, **COMMON, **extra), attn, dtype)
    x = ids(3, 80)
    est = estimate_memory(model, {"input_ids": x, "labels": x})
    exact = 5 * 3 * 80 * 64 * dtype.itemsize
    assert est.parts["checkpoint_input_bytes"] == exact
    assert est.host_bytes["checkpoint+offload"] == exact
    # the offload lowers the peak by the inputs not yet reloaded there (all but the last block's, or more)
    assert exact * 3 // 5 <= est.peak_bytes["checkpoint"] - est.peak_bytes["checkpoint+offload"] <= exact


# -- 2: hybrid sliding/full attention -----------------------------------------------------------------

LAYER_TYPES = ["full_attention"] * 8 + ["sliding_attention"] * 4  # four sliding layers of twelve


def hybrid(kind, types=LAYER_TYPES):
    n = len(types)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=16, num_hidden_layers=n, layer_types=types, sliding_window=64,
                                        use_sliding_window=True, **COMMON), "sdpa"
    if kind == "gemma2":
        return transformers.Gemma2Config(head_dim=16, num_hidden_layers=n, layer_types=types, sliding_window=64,
                                         **COMMON), "eager"
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(head_dim=16, num_hidden_layers=n, layer_types=types,
                                             sliding_window=64, **COMMON), "eager"
    if kind == "cohere2":
        return transformers.Cohere2Config(num_hidden_layers=n, layer_types=types, sliding_window=64, **COMMON), "sdpa"
    return transformers.GptOssConfig(head_dim=16, num_hidden_layers=n, layer_types=types, sliding_window=64,
                                     num_local_experts=4, num_experts_per_tok=2, **COMMON), "eager"


@pytest.mark.parametrize("kind,types", [
    ("qwen3", LAYER_TYPES),
    ("qwen3", ["full_attention", "sliding_attention", "sliding_attention"] * 4),
    ("gemma2", ["sliding_attention", "full_attention"] * 6),
    ("gemma3", ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]),
    ("cohere2", ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 8),
    ("gpt_oss", ["sliding_attention", "full_attention"] * 6),
])
def test_hybrid_attention_models_measured_by_kind_match_every_block(kind, types, monkeypatch):
    """PITFALLS 34: sliding and full attention layers measured by kind, each with its own position's mask,
    match measuring every block. Fails where representatives are renumbered 0..k-1."""
    # The kind lives on the attention module and in config.layer_types (which the model reads by
    # position): one representative per kind, each measured with the mask of its own position.
    cfg, attn = hybrid(kind, types)
    model = meta_model(cfg, attn, torch.bfloat16)
    x = ids(1, 512)
    blocks = ckpt_offload.find_repeated_blocks(model)
    few = estimate_memory(model, {"input_ids": x, "labels": x})
    every_block(monkeypatch)
    every = estimate_memory(model, {"input_ids": x, "labels": x})
    for m in every.peak_bytes:
        assert few.peak_bytes[m] == pytest.approx(every.peak_bytes[m], rel=0.03), (m, few.peak_bytes, every.peak_bytes)
    assert few.host_bytes == every.host_bytes
    # and the sliding layers' mask makes a difference worth getting right
    assert every.peak_bytes["checkpoint"] != estimate_memory(
        meta_model(hybrid(kind, ["full_attention"] * len(types))[0], attn, torch.bfloat16),
        {"input_ids": x, "labels": x}).peak_bytes["checkpoint"]
    assert len(blocks) == len(types)


# -- 3: the longest sequence of a sliding-window model -----------------------------------------------


def test_longest_sequence_of_a_sliding_window_model_fits_and_not_ten_percent_beyond():
    # The memory-efficient kernel keeps the explicit [s, s] mask of a sliding window: the peak grows
    # with the square of the length, not along a line through two lengths.
    cfg = transformers.MistralConfig(num_hidden_layers=4, sliding_window=64, **COMMON)
    model = meta_model(cfg, "sdpa", torch.bfloat16)

    def est(s):
        return estimate_memory(model, {"input_ids": ids(1, s), "labels": ids(1, s)})

    first = est(1024)
    assert first.attention == ["efficient"]
    device = 4 * first.peak_bytes["checkpoint"]
    longest = first.longest_fitting(device)
    for m in ("none", "checkpoint", "checkpoint+offload", "every_n=2"):
        s = longest[m]
        assert s > 0
        assert est(s).peak_bytes[m] <= device, (m, s)
        assert est(s + s // 10).peak_bytes[m] > device, (m, s)


# -- 5: dropout as a GPU keeps it --------------------------------------------------------------------


def test_gpt2_block_with_dropout_keeps_what_korthikanti_counts():
    """PITFALLS 35: a GPT-2 block with dropout is sized as a GPU keeps it (a 1-byte mask), against
    Korthikanti's published formula. Fails where the CPU's float noise tensor is counted."""
    # Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): a GPT
    # block in fp16 with dropout keeps sbh(34 + 5as/h) bytes, the dropout masks at one byte an element
    # (what a CUDA GPU's fused dropout keeps), and 2sbh, its input, when checkpointed.
    h, a, s, b = 256, 4, 128, 2
    cfg = transformers.GPT2Config(n_embd=h, n_head=a, n_layer=4, n_positions=1024, vocab_size=256, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                  activation_function="gelu")
    model = meta_model(cfg, "eager", torch.float16)
    est = estimate_memory(model, {"input_ids": ids(b, s), "labels": ids(b, s)})
    formula = s * b * h * (34 + 5 * a * s / h)
    kept = est.cost_model.kept
    # block 0 also keeps the model's [b, 1, s, s] mask, which every block reads
    for i in range(1, 4):
        assert kept["none"][i] == pytest.approx(formula, rel=0.05), (kept["none"], formula)
        assert kept["checkpoint"][i] == 2 * s * b * h
    assert kept["checkpoint"][0] == 2 * s * b * h + b * s * s * 2


# -- 9: valid models it could not size ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_experts_in_fp32_are_sized_and_match_the_cpu_step(kind, test_cpu, one_thread):
    # torch's meta _grouped_mm takes bf16 and fp16 only; the CPU (and GPU) kernels run fp32 too.
    from test_estimate import check_all_modes
    from tiny_gpt import make_batch

    small = dict(COMMON, num_hidden_layers=3, max_position_embeddings=256)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **small)
    else:
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          head_dim=16, **small)
    cfg._attn_implementation = "sdpa"
    x = make_batch(batch=2, seq=64, vocab=256)

    def build(device):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)

    est = check_all_modes(build, {"input_ids": x, "labels": x}, None, attention="flash")
    assert est.parts["checkpoint_input_bytes"] == 3 * 2 * 64 * 64 * 4


def test_gemma3_vision_language_text_only_step_measures_the_text_layers():
    # find_repeated_blocks finds the SigLIP layers and the text layers; on text alone only the text
    # layers run, and they are the ones measured.
    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         sliding_window=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=16),
        mm_tokens_per_image=4, image_token_index=500)
    model = meta_model(cfg, "sdpa", torch.bfloat16)
    assert len(ckpt_offload.find_repeated_blocks(model)) == 6
    est = estimate_memory(model, {"input_ids": ids(2, 128), "labels": ids(2, 128)})
    assert est.cost_model.n == 4
    assert est.parts["checkpoint_input_bytes"] == 4 * 2 * 128 * 64 * 2
    assert est.peak_bytes["none"] > est.peak_bytes["checkpoint"] > est.peak_bytes["checkpoint+offload"]


def run_cli(capsys, tmp_path, config, *args):
    from ckpt_offload.sizing.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    rc = main(["--config", str(path), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_encoder_decoder_config_gets_one_short_error(tmp_path, capsys):
    t5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 64, "d_ff": 128,
          "num_layers": 2, "num_heads": 4, "d_kv": 16, "vocab_size": 256}
    rc, out, err = run_cli(capsys, tmp_path, t5, "--seq", "64", "--device-memory", "8GiB", "--host-memory", "1TiB")
    assert rc == 2 and out == ""
    assert "'t5'" in err and "decoder-only" in err
    assert "LlamaConfig" not in err and len(err) < 400, err  # not the list of every class transformers knows


def test_longest_sequence_is_capped_at_the_positions_the_model_takes(tmp_path, capsys):
    bert = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512,
            "torch_dtype": "float32"}
    rc, out, err = run_cli(capsys, tmp_path, bert, "--seq", "256", "--device-memory", "80GiB", "--host-memory",
                           "1TiB", "--json")
    assert rc == 0, err
    out = json.loads(out)
    assert out["max_seq"] == 512
    assert all(row["longest_seq"] == 512 for row in out["modes"].values())
    rc, table, err = run_cli(capsys, tmp_path, bert, "--seq", "256", "--device-memory", "80GiB", "--host-memory",
                             "1TiB")
    assert "at most the 512 positions the model takes" in table


# -- 10: the Python API and the command count the same loss -------------------------------------------


def test_api_without_labels_counts_the_loss_the_command_counts(tmp_path, capsys):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    rc, out, err = run_cli(capsys, tmp_path, config, "--seq", "2048", "--device-memory", "8GiB", "--host-memory",
                           "1TiB", "--json")
    assert rc == 0, err
    cli = json.loads(out)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(tmp_path / "config.json")), dtype=torch.bfloat16)
    x = ids(1, 2048)
    for inputs in ((x,), {"input_ids": x}, {"input_ids": x, "labels": x}):
        api = estimate_memory(model, inputs)
        assert api.parts == cli["parts"]
        for m in api.peak_bytes:
            assert api.peak_bytes[m] == cli["modes"][m]["device_peak_bytes"], (inputs, m)
    # a loss of one's own is counted as given
    own = estimate_memory(model, (x,), loss_fn=lambda out: out.logits.float().square().mean())
    assert own.peak_bytes["checkpoint"] != cli["modes"]["checkpoint"]["device_peak_bytes"]


def test_the_longest_search_checks_the_positions_cap_itself():
    # Doubling from 1 lands on a power of two; where that is the model's cap (131072 positions), the
    # cap is the answer only if it fits there: a mode that stops fitting at 97611 must not read 131072.
    from ckpt_offload.sizing.estimate import _largest

    assert _largest(lambda s: s <= 97611, limit=131072) == 97611
    assert _largest(lambda s: s <= 131072, limit=131072) == 131072
    assert _largest(lambda s: True, limit=1000) == 1000
    assert _largest(lambda s: s <= 700, limit=1000) == 700
