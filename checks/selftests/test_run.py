"""`./check.sh run`: text in and text out on a checkpoint folder made here (tiny random Qwen3 weights saved
with `save_pretrained`, a byte-level BPE tokenizer with a chat template built with `tokenizers`), nothing
downloaded. Each run calls the command's `main` in this process, as `./check.sh run` would."""

import json
import math
import shutil

import pytest
import torch

from checks import run as run_command
from checks.harness.checkpoints import make_checkpoint
from checks.harness.loader import ROOT
from checks.harness.modules import modules
from checks.harness.stubs import stub_for

PROMPT = "The capital of France is"
NEW = 12  # tokens per completion: enough to part at a near-tie, few enough to stay cheap in the interpreter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-tiny")
    return folder, make_checkpoint(folder)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = run_command.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def hf_generate(folder, ids: list[int], dtype: torch.dtype, device: str = "cpu"):
    """HF's greedy tokens (cut after a stop token), its margin between the two best logits at each, and its best."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device)
    stops = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=stops, pad_token_id=stops[0], output_logits=True,
                             return_dict_in_generate=True)
    tokens = run_command.cut_at_stop(out.sequences[0, len(ids):].tolist(), stops)
    best = [torch.topk(step[0].float(), 2).values for step in out.logits]
    return tokens, [float(b[0] - b[1]) for b in best], [float(b[0]) for b in best]


def test_m04_float32_text_is_hf_generate_token_for_token(checkpoint, capsys):
    folder, tokenizer = checkpoint
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected, _, _ = hf_generate(folder, ids, torch.float32)
    code, out, err = run(capsys, "--model", folder, "--impl", "solutions", "--engine", "m04", "--max-tokens", NEW,
                         "--compare", PROMPT)
    assert code == 0, err
    assert "m04: your model_forward, greedy" in out and "float32 on the CPU" in out  # m04 runs on the CPU
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert out.count(text) == 2, out  # streamed, then HF's under --compare
    assert f"The same {len(expected)} tokens." in out
    assert f"prompt {len(ids)} tokens · output {len(expected)} tokens · first token after" in out
    assert "tokens/s" in out.splitlines()[out.splitlines().index("── Hugging Face generate (greedy, same weights) ──")
                                          - 2]
    # a text that parts from HF's: where, both tokens, and HF's margin there in steps of the dtype
    other = next(t for t in range(len(tokenizer)) if t != expected[3])
    run_command.compare(folder, ids, expected[:3] + [other], [], "float32", "cpu", tokenizer, NEW)
    said = capsys.readouterr().out
    assert f"They part at output token 3: yours {tokenizer.decode([other])!r} (id {other}), HF's" in said, said
    assert "steps of float32 at" in said and "A near-tie" not in said  # float32 on one machine: no tie


def test_p06_bf16_engine_agrees_with_hf_until_a_bf16_near_tie(checkpoint, capsys):
    """The reference engine in bf16 (p03's kernel takes 16-bit floats): HF's tokens, or the same up to a token
    where HF's own two best logits lie within bf16's rounding, which --compare names as a near-tie."""
    folder, tokenizer = checkpoint
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected, margins, hf_best = hf_generate(folder, ids, torch.bfloat16,
                                               "cuda" if torch.cuda.is_available() else "cpu")  # where run serves
    code, out, err = run(capsys, "--model", folder, "--impl", "solutions", "--max-tokens", NEW, "--compare", PROMPT)
    assert code == 0, err
    assert "p06: your LLM.generate, greedy (the reference)" in out and "bfloat16 on the" in out
    if f"The same {len(expected)} tokens." not in out:
        part = int(out.split("They part at output token ")[1].split(":")[0])
        assert "A near-tie: bfloat16 rounding decides it." in out, out
        assert margins[part] <= 4 * 2.0 ** (math.floor(math.log2(float(hf_best[part]))) - 7), out
    else:
        assert tokenizer.decode(expected, skip_special_tokens=True) in out


def test_chat_prompt_is_hf_apply_chat_template(checkpoint):
    _, tokenizer = checkpoint
    messages = [{"role": "user", "content": "Name three prime numbers."}]
    for thinking in (None, True, False):
        options = {} if thinking is None else {"enable_thinking": thinking}
        hf = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **options)
        hf = hf["input_ids"] if not isinstance(hf, list) else hf  # a BatchEncoding in newer transformers
        assert run_command.prompt_ids(tokenizer, messages[0]["content"], True, thinking) == list(hf)
    no_think = tokenizer.decode(run_command.prompt_ids(tokenizer, "hi", True, False))
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), no_think


def test_a_batch_of_prompts_and_a_seeded_sample_repeat(checkpoint, capsys, tmp_path):
    folder, _ = checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello!\n\nName three prime numbers.\n")
    argv = ("--model", folder, "--impl", "solutions", "--prompts", prompts, "--chat", "--max-tokens", 6,
            "--temperature", 0.8, "--top-p", 0.9, "--seed", 5)
    code, first, err = run(capsys, *argv)
    assert code == 0, err
    assert "── 1. Hello!" in first and "── 2. Name three prime numbers." in first and "── 3." not in first
    assert "temperature 0.8, top-k 0, top-p 0.9, seed 5" in first
    code, again, err = run(capsys, *argv)
    texts = [out.split("── 1.")[1].split("\nprompt ")[0] for out in (first, again)]
    assert code == 0 and texts[0] == texts[1]


def copy_checkpoint(folder, into, config_change=None, drop=()):
    into.mkdir()
    for item in folder.iterdir():
        if item.name not in drop:
            shutil.copy(item, into / item.name)
    if config_change:
        config = json.loads((into / "config.json").read_text())
        config.update(config_change)
        (into / "config.json").write_text(json.dumps(config))
    return into


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such folder"),
    ("no-config", "no config.json there"),
    ("no-tokenizer", "no tokenizer.json there"),
    ("not-qwen3", "model_type 'llama', not 'qwen3'"),
    ("untied", "has its own lm_head (tie_word_embeddings false"),
    ("no-weights", "no *.safetensors weights there"),
])
def test_a_folder_that_is_not_a_qwen3_checkpoint_is_one_line(checkpoint, capsys, tmp_path, case, expected):
    folder, _ = checkpoint
    target = {
        "missing": lambda: tmp_path / "nowhere",
        "no-config": lambda: copy_checkpoint(folder, tmp_path / "c", drop=("config.json",)),
        "no-tokenizer": lambda: copy_checkpoint(folder, tmp_path / "c", drop=("tokenizer.json",)),
        "not-qwen3": lambda: copy_checkpoint(folder, tmp_path / "c", {"model_type": "llama"}),
        "untied": lambda: copy_checkpoint(folder, tmp_path / "c", {"tie_word_embeddings": False}),
        "no-weights": lambda: copy_checkpoint(folder, tmp_path / "c", drop=("model.safetensors",)),
    }[case]()
    code, out, err = run(capsys, "--model", target, "--impl", "solutions", PROMPT)
    assert code == 2 and out == ""
    assert err.strip().startswith(f"./check.sh run: --model {target}") and expected in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_stub_says_what_to_finish_first(checkpoint, capsys, tmp_path):
    folder, _ = checkpoint
    stubs, partial = tmp_path / "stubs", tmp_path / "partial"
    stubs.mkdir()
    partial.mkdir()
    for m in modules():
        (stubs / f"{m.stem}.py").write_text(stub_for(ROOT, m.stem))
        source = ROOT / "solutions" / f"{m.stem}.py" if m.id in ("m02", "m03", "m04") else stubs / f"{m.stem}.py"
        shutil.copy(source, partial / f"{m.stem}.py")
    code, out, err = run(capsys, "--model", folder, "--impl", stubs, PROMPT)
    assert code == 2 and "a folder's p06 is served only with --engine p06" in out
    assert "`load_pretrained` raises NotImplementedError: finish m04 first (./check.sh m04)" in err, err
    code, out, err = run(capsys, "--model", folder, "--impl", partial, PROMPT)
    assert code == 2 and "reaches `rms_norm`" in err and "finish m01 first (./check.sh m01)" in err, err
    assert "Traceback" not in out + err


def test_p06_serves_once_it_passed_its_checks_and_is_unchanged_since(tmp_path, monkeypatch):
    """The learner's last results decide: never checked, partly passed, changed since, or passed."""
    import time
    from types import SimpleNamespace

    from checks.harness.loader import named

    results, auto, mine = tmp_path / "results.json", SimpleNamespace(engine="auto"), named("mine")
    monkeypatch.setattr(run_command, "RESULTS", results)
    assert run_command.choose_engine(auto, mine) == ("m04", "p06 has not been checked yet (./check.sh p06)")
    for entry, expected in (({"checks": 19, "passed": 12}, "p06 passed 12 of its 19 checks"),
                            ({"checks": 19, "passed": 19, "when": "2000-01-01 00:00"}, "changed since it passed"),
                            ({"checks": 19, "passed": 19}, "changed since it passed")):
        results.write_text(json.dumps({"p06_engine": entry}))
        engine, why = run_command.choose_engine(auto, mine)
        assert engine == "m04" and expected in why, why
    later = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() + 3600))
    results.write_text(json.dumps({"p06_engine": {"checks": 19, "passed": 19, "when": later}}))
    assert run_command.choose_engine(auto, mine)[0] == "p06"
    assert run_command.choose_engine(SimpleNamespace(engine="m04"), mine) == ("m04", "--engine m04")
    assert run_command.choose_engine(auto, named("solutions")) == ("p06", "the reference")
