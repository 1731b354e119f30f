"""The command line end to end on trivial sizes: artefacts, skip-on-rerun, errors, eval, generate."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli import app

runner = CliRunner()
QUICK = ["*.train.max_steps=2", "*.train.batch_size=4", "*.eval.n=4", "*.eval.max_new_tokens=8",
         "pretrain.data.task.n=32", "sft.data.task.n=32"]


def test_run_writes_the_run_directory_and_skips_finished_stages(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK])
    assert result.exit_code == 0, result.output
    for name in ("config.yaml", "metrics.jsonl", "results.json", "pretrain/model.safetensors",
                 "sft/model.safetensors", "sft/stage.json", "sft/tokenizer.json"):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"pretrain", "sft"} and "accuracy" in results["sft"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} == {"pretrain", "sft"} and all("step" in r for r in rows)
    assert "held-out accuracy" in result.output

    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "sft")
    AutoTokenizer.from_pretrained(out / "sft")

    before = (out / "metrics.jsonl").read_text()
    again = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK, "*.train.log_every=1"])
    assert again.exit_code == 0, again.output  # a setting that changes nothing trained is not a change
    assert (out / "metrics.jsonl").read_text() == before  # both stages skipped
    assert not (out / ".lock").exists()  # released

    changed = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK, "sft.optim.lr=0.005"])
    assert changed.exit_code == 2 and "Traceback" not in changed.output
    message = " ".join(changed.output.split())
    assert "stage 'sft'" in message and "trained under another configuration" in message
    assert "optim.lr: 0.002 -> 0.005" in message and "new --out" in message
    assert (out / "metrics.jsonl").read_text() == before and "0.005" not in (out / "config.yaml").read_text()

    plan = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK, "--dry-run"])
    assert plan.exit_code == 0 and plan.output.count("skip (finished)") == 2, plan.output
    fresh = tmp_path / "fresh"
    plan = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(fresh), *QUICK, "--dry-run"])
    assert plan.exit_code == 0 and "@run/pretrain" in plan.output and not fresh.exists()
    refused = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK, "sft.optim.lr=0.005",
                                  "--dry-run"])
    assert refused.exit_code == 2 and "another configuration" in refused.output


def test_bad_override_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(tmp_path), "sft.train.max_stepz=3"])
    assert result.exit_code == 2
    assert "max_stepz" in result.output and "max_steps" in result.output


def test_broken_dataset_fails_with_file_row_and_field(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "", "completion": "3"}\n')
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{name_or_path: tether/tiny}}\ndata: {{path: {data}}}\n"
                      "train: {max_steps: 1, batch_size: 1}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["sft", "--config", str(config), "--out", str(out)])
    assert result.exit_code != 0
    message = str(result.exception) + result.output
    assert "train.jsonl" in message and "line 2" in message and "prompt" in message
    assert not (out / "sft" / "stage.json").exists()
    assert not (out / "results.json").exists()


def test_eval_and_generate(tmp_path):
    from tether.models import save_tiny

    model = save_tiny(tmp_path / "tiny")
    result = runner.invoke(app, ["eval", "--model", str(model), "--n", "4", "--max-new-tokens", "4", "-k", "2",
                                 "--out", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert {"accuracy", "pass@2"} <= set(figures)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n{"prompt": "2+3="}\n')
    result = runner.invoke(app, ["generate", "--model", str(model), "--prompts", str(prompts), "--n", "3",
                                 "--max-new-tokens", "4", "--out", str(tmp_path / "gen.jsonl"), "--seed", "1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["prompt_id"] for r in rows} == {0, 1}
    assert {"completion", "tokens", "finish_reason", "sample"} <= set(rows[0])


def test_recipes_lists_the_default():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0 and "r1-arithmetic" in result.output and "(default)" in result.output


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "stage", "threshold"), [("sft-arithmetic", "sft", 0.8)])
def test_recipe_reaches_its_figure(tmp_path, recipe, stage, threshold):
    result = runner.invoke(app, ["run", recipe, "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "results.json").read_text())[stage]["accuracy"] >= threshold


@pytest.mark.slow
def test_r1_recipe_grpo_beats_sft_over_five_seeds(tmp_path):
    """The default recipe's gain over seeds 0-4 (about 25 min at --parallel 2 on 2 cores). Measured 2026-12-01
    (docs/figures-over-seeds.md): paired gain of GRPO over SFT +9.1 +- 3.6 points, 95% interval of the mean
    [+4.6, +13.6], every seed between +3.3 and +12.7. At 1 thread the runs repeat bitwise on the same
    machine; the thresholds leave room for other CPUs: a mean of at least +5 points (about one std below the
    measured mean) and an interval that excludes zero."""
    result = runner.invoke(app, ["run", "r1-arithmetic", "--seeds", "5", "--parallel", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    gain = json.loads((tmp_path / "results.json").read_text())["grpo"]["gain/accuracy"]
    assert gain["n"] == 5 and gain["mean"] >= 0.05 and gain["ci95"][0] > 0, gain


def test_a_trainer_set_up_error_is_one_line_without_a_traceback(tmp_path):
    recipe = tmp_path / "no-reward.yaml"
    recipe.write_text("name: no-reward\nstages:\n  - {name: grpo, type: grpo, model: {name_or_path: tether/tiny}, "
                      "rewards: [], train: {max_steps: 1, batch_size: 2}}\n")
    result = runner.invoke(app, ["run", str(recipe), "--out", str(tmp_path / "run")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "error: stage 'grpo' needs a reward" in result.output


def test_invalid_values_are_listed_one_per_line_without_links(tmp_path):
    result = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(tmp_path), "sft.train.max_steps=-1",
                                 "sft.optim.lr=abc"])
    assert result.exit_code == 2
    assert "2 problems" in result.output and "errors.pydantic" not in result.output
    assert "\n  optim.lr: Input should be a valid number" in result.output
    assert "\n  train.max_steps: Input should be greater than or equal to 1 (got -1)" in result.output


@pytest.mark.parametrize("algorithm", ["rloo", "gspo"])  # every preset trains in test_rl.py
def test_grpo_command_takes_a_preset_override(tmp_path, algorithm):
    config = tmp_path / "grpo.yaml"
    config.write_text("model: {name_or_path: tether/tiny}\n"
                      "data: {task: {name: arithmetic, n: 8}}\n"
                      "rollout: {group_size: 2, max_new_tokens: 4}\n"
                      "train: {max_steps: 1, batch_size: 2}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["grpo", "--config", str(config), "--out", str(out), f"algorithm={algorithm}"])
    assert result.exit_code == 0, result.output
    import yaml

    resolved = yaml.safe_load((out / "config.yaml").read_text())["stages"][0]
    assert resolved["algorithm"] == algorithm
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/total/mean" in r for r in rows)


def test_ppo_command_runs_one_stage_with_overrides(tmp_path):
    config = tmp_path / "ppo.yaml"
    config.write_text("model: {name_or_path: tether/tiny}\n"
                      "data: {task: {name: arithmetic, n: 8}}\n"
                      "rollout: {max_new_tokens: 4}\n"
                      "rewards: [{name: length, kwargs: {target: 2}}]\n"
                      "critic: {init: policy}\n"
                      "train: {max_steps: 1, batch_size: 2}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["ppo", "--config", str(config), "--out", str(out), "kl.controller=adaptive",
                                 "ppo_epochs=1"])
    assert result.exit_code == 0, result.output
    assert (out / "ppo" / "stage.json").exists() and (out / "ppo" / "value" / "model.safetensors").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"kl_coef", "value/loss", "value/explained_variance", "reward/mean", "kl"} <= set(rows[-1])


def test_resume_without_out_continues_the_newest_unfinished_run(tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["run", "sft-arithmetic", "--resume", *QUICK]).exit_code == 2  # none to resume
    older = tmp_path / "runs" / "sft-arithmetic-20260101-000000"
    assert runner.invoke(app, ["run", "sft-arithmetic", "--out", str(older), *QUICK]).exit_code == 0
    newer = tmp_path / "runs" / "sft-arithmetic-20260102-000000"
    shutil.copytree(older, newer)  # finished: not a candidate
    (older / "sft" / "stage.json").unlink()  # the older run's last stage did not finish
    result = runner.invoke(app, ["run", "sft-arithmetic", "--resume", *QUICK])
    assert result.exit_code == 0, result.output
    assert "sft-arithmetic-20260101-000000" in " ".join(result.output.split())
    assert (older / "sft" / "stage.json").exists() and not list((tmp_path / "runs").glob("*-2026120*"))


@pytest.mark.parametrize("case", ["out_is_a_file", "every_prompt_too_long", "smaller_than_one_batch"])
def test_ordinary_mistakes_end_in_one_line(tmp_path, case):
    data = tmp_path / "data.jsonl"
    out = tmp_path / "out"
    config = {"model": {"name_or_path": "tether/tiny"}, "data": {"path": str(data)},
              "train": {"max_steps": 1, "batch_size": 4, "progress": False}, "report_to": []}
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) for i in range(64)))
    expected = {"out_is_a_file": "is a file, not a directory", "every_prompt_too_long": "longer than data.max_length",
                "smaller_than_one_batch": "give more data or lower train.batch_size"}[case]
    if case == "out_is_a_file":
        out.write_text("x")
    elif case == "every_prompt_too_long":
        data.write_text(json.dumps({"prompt": "1" * 300, "completion": "2"}) + "\n")
        config["data"].update(max_length=32, overflow="drop")
    else:
        data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
        config["data"]["packing"] = False
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["sft", "--config", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()) and "Traceback" not in result.output


def test_a_full_disk_outside_a_checkpoint_is_one_line(tmp_path, monkeypatch):
    import errno

    from tether.trainers.metrics import MetricsLogger

    def full(self, step, metrics):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MetricsLogger, "log", full)
    config = tmp_path / "sft.yaml"
    config.write_text("model: {name_or_path: tether/tiny}\ndata: {task: {name: arithmetic, n: 16}}\n"
                      "train: {max_steps: 2, batch_size: 4}\n")
    result = runner.invoke(app, ["sft", "--config", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and (result.exception is None or isinstance(result.exception, SystemExit))
    assert "error: the disk is full (" in result.output and "--resume" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", ["out_not_writable", "reward_module_missing"])
def test_an_unwritable_out_and_a_reward_that_cannot_be_imported_end_in_one_line(tmp_path, case):
    config = {"model": {"name_or_path": "tether/tiny"}, "data": {"task": {"name": "arithmetic", "n": 16}},
              "train": {"max_steps": 1, "batch_size": 4, "progress": False}, "report_to": []}
    out = tmp_path / "out"
    if case == "out_not_writable":  # a read-only file system (even root cannot create a folder in /proc)
        out = Path("/proc") / "tether-test-out"
        expected, command = "cannot create the run directory", "sft"
    else:
        config["rewards"] = [{"name": "no_such_package_xyz.rewards:brevity"}]
        expected, command = "no_such_package_xyz", "grpo"
    path = tmp_path / "stage.yaml"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, [command, "--config", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert expected in text and "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 3


def test_dpo_command_takes_a_stage_prefixed_loss_override_dmpo_on_episode_pairs(tmp_path):
    turn = [{"role": "assistant", "content": "Action: calculator[2*3]"}, {"role": "tool", "content": "6"}]
    pairs = [{"prompt": [{"role": "user", "content": f"{k}*3="}],
              "chosen": [*turn, {"role": "assistant", "content": "Action: finish[6]"}],
              "rejected": [{"role": "assistant", "content": "Action: finish[5]"}]} for k in range(4)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    config = tmp_path / "dpo.yaml"
    config.write_text(f"model: {{name_or_path: tether/tiny}}\ndata: {{path: {data}}}\n"
                      "train: {max_steps: 1, batch_size: 4}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["dpo", "--config", str(config), "--out", str(out), "dpo.loss=dmpo",
                                 "dmpo_gamma=0.5"])
    assert result.exit_code == 0, result.output
    import yaml

    resolved = yaml.safe_load((out / "config.yaml").read_text())["stages"][0]
    assert resolved["loss"] == "dmpo" and resolved["dmpo_gamma"] == 0.5
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("turns/chosen") == 2.0 and r.get("turns/rejected") == 1.0 for r in rows), rows


def test_stages_runs_a_stage_with_what_it_uses_and_a_later_full_run_reuses_it(tmp_path):
    out = tmp_path / "run"
    plan = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK, "--stages", "pretrain", "--dry-run"])
    assert plan.exit_code == 0 and "│ pretrain │" in plan.output and "│ sft " not in plan.output, plan.output
    result = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK, "--stages", "pretrain"])
    assert result.exit_code == 0, result.output
    assert set(json.loads((out / "results.json").read_text())) == {"pretrain"} and not (out / "sft").exists()
    full = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(out), *QUICK])
    assert full.exit_code == 0 and "stage pretrain already finished" in " ".join(full.output.split()), full.output
    assert set(json.loads((out / "results.json").read_text())) == {"pretrain", "sft"}
    unknown = runner.invoke(app, ["run", "sft-arithmetic", "--out", str(tmp_path / "x"), "--stages", "stf"])
    assert unknown.exit_code == 2 and "Traceback" not in unknown.output
    assert "no stage 'stf' in recipe 'sft-arithmetic'; its stages: pretrain, sft" in " ".join(unknown.output.split())
