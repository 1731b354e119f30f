"""Bulk generation: every (prompt, sample) exactly once, across a kill, a torn line and a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from tether.config import ConfigError
from tether.generation import generate_corpus, generate_file, read_corpus, recover_journal
from tether.models.tiny import build_tokenizer
from tether.rollout import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def pairs(records) -> Counter:
    return Counter((r["prompt_id"], r["sample"]) for r in records)


def script(prompt: str, sample: int) -> str:
    return f"{prompt}#{sample}"


def test_records_carry_ids_columns_and_counts(tmp_path, scripted_engine):
    tokenizer = build_tokenizer()
    engine = scripted_engine(tokenizer, script)
    prompts = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    stats = generate_corpus(engine, tokenizer, prompts, tmp_path / "c.jsonl", SamplingParams(n=3), batch_size=6,
                            progress=False)
    records = read_corpus(tmp_path / "c.jsonl")
    assert stats["records"] == 15 and stats["generated"] == 15 and stats["resumed"] == 0
    assert engine.calls == 3  # 6 samples a call = 2 prompts a call: 2 + 2 + 1
    assert pairs(records) == Counter({(p, s): 1 for p in range(5) for s in range(3)})
    r = next(r for r in records if r["prompt_id"] == 3 and r["sample"] == 2)
    assert r["completion"] == "3+1=#2" and r["answer"] == "4" and r["prompt"] == "3+1="
    assert r["tokens"] == len("3+1=#2") + 1 and r["finish_reason"] == "stop"  # characters + EOS


def test_resume_skips_done_pairs_and_regenerates_a_torn_line(tmp_path, scripted_engine):
    tokenizer = build_tokenizer()
    out = tmp_path / "c.jsonl"
    prompts = [f"p{i}" for i in range(4)]
    generate_corpus(scripted_engine(tokenizer, script), tokenizer, prompts[:4], out, SamplingParams(n=2),
                    batch_size=2, progress=False)
    lines = out.read_text().splitlines(keepends=True)
    # a kill after 5 records and in the middle of the 6th: keep 5 lines and half of the next
    out.write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    engine = scripted_engine(tokenizer, script)
    stats = generate_corpus(engine, tokenizer, prompts, out, SamplingParams(n=2), batch_size=2, progress=False)
    records = read_corpus(out)
    assert stats["resumed"] == 5 and stats["generated"] == 3 and stats["records"] == 8
    assert pairs(records) == Counter({(p, s): 1 for p in range(4) for s in range(2)})
    assert engine.samples == 4  # prompt 2 (half done) is sampled whole, its missing sample kept; prompt 3
    assert out.read_text().endswith("\n") and all(json.loads(line) for line in out.read_text().splitlines())


def test_a_corrupt_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt_id": 0, "sample": 0}\n{"prompt_id": 0, "sa\n{"prompt_id": 1, "sample": 0}\n')
    with pytest.raises(ValueError, match="line 2"):
        recover_journal(path)


def test_parquet_output_and_changed_settings_refuse_to_resume(tmp_path, scripted_engine):
    tokenizer = build_tokenizer()
    out = tmp_path / "c.parquet"
    generate_corpus(scripted_engine(tokenizer, script), tokenizer, ["a", "b"], out, SamplingParams(n=2),
                    progress=False)
    assert out.exists() and not (tmp_path / "c.partial.jsonl").exists()
    assert pairs(read_corpus(out)) == Counter({(p, s): 1 for p in range(2) for s in range(2)})
    with pytest.raises(ConfigError, match="temperature"):
        generate_corpus(scripted_engine(tokenizer, script), tokenizer, ["a", "b"], out,
                        SamplingParams(n=2, temperature=0.5), progress=False)
    # starting over is allowed, and draws everything again
    engine = scripted_engine(tokenizer, script)
    generate_corpus(engine, tokenizer, ["a", "b"], out, SamplingParams(n=2, temperature=0.5), resume=False,
                    progress=False)
    assert engine.samples == 4


def test_sigkill_mid_run_then_resume_gives_every_pair_exactly_once(tmp_path):
    """A real kill: the CLI generating in a subprocess gets SIGKILL after some records are on disk."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(40)))
    out = tmp_path / "gen.jsonl"
    args = dict(n=2, max_new_tokens=48, seed=3, batch_size=4)
    cmd = [sys.executable, "-m", "tether.cli", "generate", "--model", "tether/tiny", "--prompts", str(prompts),
           "--out", str(out), *(x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v)))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 6:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"generation ended before the kill: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = len(recover_journal(out))
    assert 6 <= at_kill < 80
    stats = generate_file("tether/tiny", prompts, out, progress=False, **args)
    records = read_corpus(out)
    assert stats["resumed"] == at_kill and stats["generated"] == 80 - at_kill
    assert pairs(records) == Counter({(p, s): 1 for p in range(40) for s in range(2)})


def test_openai_engine_through_a_loopback_server_writes_the_same_records(tmp_path):
    serve = pytest.importorskip("tether.serve")
    from tether.models import save_tiny

    model_dir = save_tiny(tmp_path / "tiny")
    from tether.models import load_model

    model, tokenizer = load_model(str(model_dir))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+3=", "answer": "5"}\n')
    with serve.BackgroundServer(serve.create_app(model, tokenizer, model_name="tiny")) as server:
        stats = generate_file("tiny", prompts, tmp_path / "http.jsonl", n=3, max_new_tokens=5, seed=0,
                              engine="openai", base_url=server.base_url, tokenizer=str(model_dir), progress=False)
    records = read_corpus(tmp_path / "http.jsonl")
    assert stats["records"] == 6 and pairs(records) == Counter({(p, s): 1 for p in range(2) for s in range(3)})
    assert {r["answer"] for r in records} == {"2", "5"} and all(r["finish_reason"] in ("stop", "length")
                                                                 for r in records)
    with pytest.raises(ConfigError, match="base URL"):
        generate_file("tiny", prompts, tmp_path / "x.jsonl", engine="openai", progress=False)
