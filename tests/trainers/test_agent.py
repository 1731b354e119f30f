"""Agentic RL: observation tokens get exactly zero gradient, the reward rises, resume is exact, SFT masks tools."""

from collections import defaultdict

import pytest
import torch

from tether.config.agent import AgentEpisodesConfig, EnvironmentConfig
from tether.data import tokenize_sft
from tether.data.packing import pack_sequences
from tether.data.prefix_sharing import pack_prefix_groups
from tether.models import build_tiny
from tether.rollout.agent import demonstration_records
from tether.trainers.agent import AgentConfig, AgentRLTrainer, gigpo_token_advantages

ENV = {"task": {"name": "multiplication", "options": {"digits": 2}, "n": 64}, "tools": ["calculator"],
       "system_prompt": False, "max_observation_chars": 24}


def generated_digits(prompts, completions, trajectory, **columns):
    """A dense reward on the policy's own text: the fraction of generated characters that are digits."""
    texts = ["".join(turn.text for turn in t.turns) for t in trajectory]
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in texts]


def config(**overrides):
    data = dict(name="agent", algorithm="grpo", environment=ENV,
                agent={"max_turns": 3, "max_tokens": 120, "max_tokens_per_turn": 12},
                rollout={"group_size": 4}, row_tokens=256, kl={"coef": 0.05},
                train={"max_steps": 8, "batch_size": 4, "log_every": 1, "progress": False},
                optim={"lr": 1e-2, "schedule": "constant"}, report_to=[])
    data.update(overrides)
    return AgentConfig(**data)


def trainer(tmp_path, cfg, rewards=(generated_digits,)):
    model, tokenizer = build_tiny("tiny", seed=0)
    return AgentRLTrainer(cfg, model, tokenizer, tmp_path, reward_functions=list(rewards))


@pytest.mark.parametrize("share", [True, False], ids=["prefix-shared", "plain-packed"])
@pytest.mark.parametrize("kl", [{"coef": 0.1, "estimator": "k3"}, {"coef": 0.1, "estimator": "k1", "in_reward": True}])
def test_observation_token_logits_get_exactly_zero_gradient(tmp_path, kl, share):
    """One full training step (policy loss, KL, entropy bonus, two passes with old log-probs): the gradient
    reaching the logits that score observation tokens is exactly zero; the policy's tokens get gradient.
    Both update layouts: a group's completions sharing their prompt, and side by side."""
    t = trainer(tmp_path, config(kl=kl, entropy={"coef": 0.01}, num_iterations=2, prefix_sharing=share,
                                 train={"max_steps": 1, "batch_size": 2, "progress": False}))
    captured = []

    def keep(module, inputs, output):
        if torch.is_grad_enabled():
            output.retain_grad()
            captured.append(output)

    t.model.lm_head.register_forward_hook(keep)
    collect, loss = t.collect, t.loss
    batches, row_orders = [], []
    t.collect = lambda: batches.append(collect()) or batches[-1]
    t.loss = lambda batch, rows, *args: row_orders.append(rows.tolist()) or loss(batch, rows, *args)
    t.training_step()
    rollout = batches[0].rollout
    assert len(captured) == len(row_orders) == 2 and sum(sum(m) < len(m) for m in rollout.action_masks) > 0
    for logits, order in zip(captured, row_orders, strict=True):
        # the update forward's layout: each group's completions share their common prefix, or side by side
        index = {}
        groups = [index.setdefault(tuple(rollout.prompt_ids[i]), len(index)) for i in order]
        sequences = [rollout.prompt_ids[i] + rollout.completion_ids[i] for i in order]
        layout = dict(row_tokens=t.config.row_tokens, pad_token_id=t.tokenizer.pad_token_id)
        packed = pack_prefix_groups(sequences, groups, **layout) if share else pack_sequences(sequences, **layout)
        serves = defaultdict(set)  # logits position -> masks of the tokens it scores
        for j, i in enumerate(order):
            p = len(rollout.prompt_ids[i])
            for k, m in enumerate(rollout.action_masks[i]):
                at = p + k - 1  # the position whose logits score completion token k
                column = int(packed.columns[j, at]) if share else int(packed.starts[j]) + at
                serves[int(packed.rows[j]), column].add(m)
        grad = logits.grad
        observed = generated = 0
        for (row, col), masks in serves.items():
            g = grad[row, col]
            if masks == {0}:
                assert torch.count_nonzero(g) == 0
                observed += 1
            elif 1 in masks:
                generated += int(torch.count_nonzero(g) > 0)
        assert observed > 0 and generated > 0


def test_agent_rl_raises_the_reward(tmp_path):
    t = trainer(tmp_path, config(train={"max_steps": 6, "batch_size": 2, "progress": False}))
    rewards = []
    for _ in range(6):
        metrics = t.training_step()
        t.step += 1
        rewards.append(float(metrics["reward/total/mean"]))
        assert metrics["agent/observation_tokens"] > 0 and metrics["agent/turns"] >= 1
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards


def test_resume_reproduces_the_run(tmp_path):
    cfg = config(train={"max_steps": 3, "batch_size": 2, "log_every": 1, "progress": False, "save_every": 2},
                 rollout={"group_size": 2})
    full = trainer(tmp_path / "a", cfg)
    full.train()
    resumed = trainer(tmp_path / "b", cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 2})}))
    resumed.train()
    again = trainer(tmp_path / "b", cfg)
    again.train(resume=True)
    for a, b in zip(full.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_gigpo_step_advantages_follow_anchor_states(tmp_path):
    """Two episodes of one task share their first state (no observation yet); one stops after a turn
    with reward 1, the other takes two turns and gets 1 too. With gamma 0.5 the first turns' returns are
    1 and 0.5: step advantages +1 and -1 (normalised). The second episode's second turn is alone in its
    state: 0."""
    from tether.rollout.agent import Trajectory, Turn
    from tether.trainers.agent import GiGPOConfig

    short = Trajectory(task={}, group=0, prompt_ids=[1], token_ids=[5, 6, 7], action_mask=[1, 1, 1],
                       turns=[Turn("a", "final")], turn_spans=[(0, 3)], state_keys=[""])
    long = Trajectory(task={}, group=0, prompt_ids=[1], token_ids=[5, 6, 9, 9, 7], action_mask=[1, 1, 0, 0, 1],
                      turns=[Turn("b", "tool"), Turn("c", "final")], turn_spans=[(0, 2), (4, 5)],
                      state_keys=["", "obs"])
    step = gigpo_token_advantages([short, long], torch.tensor([1.0, 1.0]), 2, 6, GiGPOConfig(gamma=0.5))
    assert torch.allclose(step, torch.tensor([[1.0, 1, 1, 0, 0, 0], [-1, -1, 0, 0, 0, 0]]), atol=1e-4)


def test_gigpo_adds_the_step_term_to_the_episode_advantage(tmp_path):
    from tether.core.advantages import AdvantageInputs, compute_advantages

    cfg = config(gigpo={"weight": 0.5, "gamma": 0.9}, train={"max_steps": 1, "batch_size": 2, "progress": False})
    t = trainer(tmp_path, cfg)
    batch = t.collect()
    t.prepare(batch)
    rollout, rewards, mask = batch.rollout, batch.rewards, batch.mask
    inputs = AdvantageInputs(rewards=rewards, mask=mask, group_size=4)
    step = gigpo_token_advantages(rollout.trajectories, rewards, 4, mask.shape[1], cfg.gigpo)
    assert step.abs().sum() > 0
    assert torch.allclose(t.advantages(batch).advantages,
                          compute_advantages("grpo", inputs).advantages + 0.5 * step * mask)


def test_sft_demonstrations_mask_the_observations():
    tokenizer = build_tiny()[1]
    env = {**ENV, "tools": ["calculator", "python"], "task": {"name": "multiplication", "n": 8}}
    from tether.rollout.environment import EnvironmentConfig

    for record in demonstration_records(EnvironmentConfig(**env), tokenizer):
        example = tokenize_sft(record, tokenizer, max_length=512)
        tool = next(m["content"] for m in record["messages"] if m["role"] == "tool")
        text = tokenizer.decode(example.input_ids)
        start = text.index("<|tool|>")
        # character tokenizer: one token per character after the special tokens
        ids, labels = example.input_ids, example.labels
        tool_at = ids.index(tokenizer.convert_tokens_to_ids("<|tool|>"))
        assert all(label == -100 for label in labels[tool_at: tool_at + 1 + len(tool) + 2])
        trained = tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
        assert tool not in trained.split("</s>")[0] and trained.endswith("</s>") and start > 0
        assert trained.count("Action:") == 2


def test_text_rendering_demonstrations_are_segments_with_loss_on_the_turns_only():
    env = EnvironmentConfig(**{**ENV, "rendering": "text"})
    for record in demonstration_records(env, build_tiny("tiny")[1], n=4, workers=1):
        pieces = record["segments"]
        assert pieces[0] == {"text": f"Question: {pieces[0]['text'].split('Question: ')[1]}", "loss": False}
        assert [p["loss"] for p in pieces[1:]] == [True, False] * ((len(pieces) - 2) // 2) + [True]
        assert all(p["text"].endswith("\nObservation:") for p in pieces[1:-1:2])
        assert all(p["text"].startswith(" ") and p["text"].endswith("\n") for p in pieces[2:-1:2])
        assert pieces[-1]["text"].startswith("Action: finish[")


@pytest.mark.slow
def test_text_rendering_sft_teaches_plain_react_and_rl_runs_on_it(tmp_path):
    """rendering: text end to end: SFT on plain-text demonstrations teaches the format (held-out successes
    after 200 steps), and GRPO's episodes are plain text with no chat-template marker."""
    import json

    from tether import stages  # noqa: F401
    from tether.stages.pipeline import run_recipe

    env = {"task": {"name": "multiplication", "options": {"digits": 2, "tools": ["calculator"]}, "n": 50},
           "tools": ["calculator"], "system_prompt": False, "rendering": "text", "eval_n": 8}
    agent = {"max_turns": 3, "max_tokens": 128, "max_tokens_per_turn": 40, "tool_workers": 1}
    recipe = {"name": "text-react", "defaults": {"model": {"name_or_path": "tether/tiny", "seed": 0},
                                                 "train": {"threads": 1, "progress": False},
                                                 "environment": env, "agent": agent},
              "stages": [{"name": "sft", "type": "agent_sft", "train": {"max_steps": 200, "batch_size": 16},
                          "optim": {"lr": 3.0e-3, "warmup_steps": 5}, "eval": {"n": 8}},
                         {"name": "grpo", "type": "agent", "algorithm": "grpo", "model": {"name_or_path": "@sft"},
                          "train": {"max_steps": 2, "batch_size": 4}}]}
    results = run_recipe(recipe, tmp_path, report=False)
    assert results["sft"]["success"] > 0
    samples = [json.loads(line) for line in (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<|" not in s["completion"] for s in samples)
    assert any("\nObservation: " in s["completion"] for s in samples)


def test_agent_config_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="step scores"):
        AgentConfig(advantage="grpo_process", process_reward={"path": "runs/prm"})
    assert AgentConfig().rewards[0].name == "trajectory"
    with pytest.raises(ValueError, match="group_size >= 2"):
        AgentConfig(dynamic_sampling={"enabled": True}, rollout={"group_size": 1})
    with pytest.raises(ValueError, match="set action_format: react"):
        EnvironmentConfig(rendering="text", action_format="hermes")
    with pytest.raises(ValueError, match="rendering: chat"):
        AgentEpisodesConfig(environment={"rendering": "text"})
    with pytest.raises(ValueError, match=r"<= agent\.max_tokens \(32\)"):
        AgentConfig(overlong={"buffer": 64}, agent={"max_tokens": 32})


def test_agent_remax_baselines_each_task_with_its_greedy_episode(tmp_path):
    """ReMax (Li et al. 2023) on episodes: the baseline of a task's sampled episodes is the reward of one greedy
    episode of that task, run through the same multi-turn loop and verifier."""
    from tether.rollout import SamplingParams

    t = trainer(tmp_path, config(algorithm="remax", train={"max_steps": 1, "batch_size": 3, "progress": False}))
    assert t.config.advantage == "remax"
    batch = t.collect()
    baseline = t.greedy_baseline(batch)
    greedy = t.loop.run([t.records[i] for i in batch.prompt_indices], SamplingParams(greedy=True))
    assert [g.task for g in greedy] == [t.records[i] for i in batch.prompt_indices] and all(g.turns for g in greedy)
    expected = torch.tensor(generated_digits(None, None, greedy), dtype=baseline.dtype).repeat_interleave(4)
    assert baseline.shape == (12,) and torch.allclose(baseline, expected)
    t.prepare(batch)
    advantages = t.advantages(batch).advantages
    assert torch.allclose(advantages[:, 0], (batch.rewards - baseline) * (batch.mask[:, 0] != 0), atol=1e-6)
    before = [p.detach().clone() for p in t.model.parameters()]
    metrics = t.training_step()  # a whole step: collect, greedy baseline, update
    assert metrics["policy/loss"] == metrics["policy/loss"] and metrics["agent/turns"] >= 1
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))


def test_agent_dynamic_sampling_keeps_only_groups_whose_rewards_differ(tmp_path):
    """DAPO's dynamic sampling over episodes (``algorithm: dapo``): tasks with an odd answer score 0 in every
    episode, so their groups are dropped and refilled with new tasks' episodes; the batch still holds
    ``batch_size`` whole groups, each with reward variance (the last round's excepted), and the figures are the
    first round's."""

    def even_answers_only(prompts, completions, trajectory, answer, **columns):
        digits = generated_digits(prompts, completions, trajectory)
        return [d if int(a) % 2 == 0 else 0.0 for d, a in zip(digits, answer, strict=True)]

    cfg = config(algorithm="dapo", overlong=None, dynamic_sampling={"enabled": True, "max_rounds": 6},
                 train={"max_steps": 1, "batch_size": 4, "progress": False})
    assert cfg.clip.high == 0.28 and cfg.loss_agg == "token-mean"  # the dapo preset; the kl here is explicit
    t = trainer(tmp_path, cfg, rewards=(even_answers_only,))
    rounds = []
    sample_round = t.sample_round
    t.sample_round = lambda indices, r: rounds.append((list(indices), r)) or sample_round(indices, r)
    batch = t.collect()
    assert len(rounds) > 1 and [r for _, r in rounds] == list(range(len(rounds)))
    dropped = batch.metrics["dynamic_sampling/dropped_groups"]
    assert dropped == sum(len(indices) for indices, _ in rounds) - 4 > 0
    assert len(batch.prompt_indices) == 4 and len(batch.rollout) == 16 == len(batch.rollout.trajectories)
    groups = batch.scores.view(4, 4)
    last_round = set(rounds[-1][0])
    for index, group, start in zip(batch.prompt_indices, groups, range(0, 16, 4), strict=True):
        assert all(t.task is batch.rollout.trajectories[start].task for t in batch.rollout.trajectories[start:start + 4])
        assert batch.rollout.trajectories[start].task is t.records[index]
        assert index in last_round or group.max() > group.min()
    assert batch.metrics["agent/turns"] >= 1 and batch.rollout.prompt_index == [i // 4 for i in range(16)]


def test_agent_overlong_shaping_counts_the_episode_tokens_against_the_episode_budget(tmp_path):
    from tether.rewards import overlong_penalty

    cfg = config(overlong={"buffer": 120, "penalty": 0.5})  # buffer = agent.max_tokens: every token costs
    t = trainer(tmp_path, cfg, rewards=(lambda prompts, completions, **columns: [0.0] * len(completions),))
    rollout, rewards, _ = t.sample_round(t.next_prompts(4), 0)
    lengths = torch.tensor([float(len(tr.token_ids)) for tr in rollout.trajectories])
    assert any(0 in tr.action_mask for tr in rollout.trajectories)  # observation tokens count too
    assert torch.equal(rewards, overlong_penalty(lengths, max_length=120, buffer=120, penalty=0.5))
    assert torch.allclose(rewards, -0.5 * lengths / 120)


@pytest.mark.slow
def test_agent_arithmetic_recipe_raises_held_out_success(tmp_path):
    from tether import stages  # noqa: F401
    from tether.stages.pipeline import apply_recipe_overrides, load_recipe, run_recipe

    recipe = apply_recipe_overrides(load_recipe("agent-arithmetic"), ["*.train.threads=1", "*.train.progress=false"])
    results = run_recipe(recipe, tmp_path, report=False)
    assert results["grpo"]["success"] > results["sft"]["success"], results


def test_agent_signal_study_changes_one_thing_per_stage():
    """The study's RL stages start from the same SFT model in the same environment, at the same policy
    learning rate; GRPO and PPO sample the same number of episodes and differ in the advantage (a critic's
    GAE against the group baseline); the dynamic stage is GRPO with dynamic sampling and nothing else
    changed; the compare stage draws all three."""
    from tether.stages.pipeline import validate_recipe
    from tether.stages.recipes import load_recipe

    configs = {c.name: c for c in validate_recipe(load_recipe("agent-signal-study"))}
    assert [c.type for c in configs.values()] == ["agent_sft", "agent", "agent", "agent", "compare"]
    grpo, dynamic, ppo = configs["grpo"], configs["dynamic"], configs["ppo"]
    assert dynamic.dynamic_sampling.enabled and not grpo.dynamic_sampling.enabled
    assert dynamic.model_copy(update={"name": "grpo", "dynamic_sampling": grpo.dynamic_sampling}) == grpo

    def episodes(c):
        return c.train.max_steps * c.train.batch_size * c.rollout.group_size

    assert episodes(grpo) == episodes(ppo) == 2560
    assert grpo.model.name_or_path == ppo.model.name_or_path == "sft" and grpo.optim.lr == ppo.optim.lr
    assert grpo.environment == ppo.environment == configs["sft"].environment and grpo.agent == ppo.agent
    assert grpo.critic is None and grpo.advantage == "grpo" and grpo.rollout.group_size == 8
    assert ppo.critic.init == "policy" and ppo.advantage == "gae" and ppo.rollout.group_size == 1
    assert configs["agent-signal"].stages == ["grpo", "dynamic", "ppo"]


@pytest.mark.slow
def test_agent_signal_study_raises_held_out_success_in_every_rl_stage(tmp_path):
    from tether import stages  # noqa: F401
    from tether.stages.pipeline import apply_recipe_overrides, load_recipe, run_recipe

    recipe = apply_recipe_overrides(load_recipe("agent-signal-study"), ["*.train.threads=1", "*.train.progress=false"])
    results = run_recipe(recipe, tmp_path, report=False)
    for stage in ("grpo", "dynamic", "ppo"):
        assert results[stage]["success"] > results["sft"]["success"] + 0.2, results
    assert (tmp_path / "agent-signal.png").stat().st_size > 0


@pytest.mark.slow
def test_code_tests_recipe_runs_end_to_end(tmp_path):
    from tether import stages  # noqa: F401
    from tether.stages.pipeline import apply_recipe_overrides, load_recipe, run_recipe

    recipe = apply_recipe_overrides(load_recipe("code-tests"), ["*.train.threads=1", "*.train.progress=false"])
    results = run_recipe(recipe, tmp_path, report=False)
    for stage in ("sft", "grpo"):
        assert 0.0 <= results[stage]["success"] <= 1.0 and results[stage]["finish/answer"] > 0.5, results


def test_agent_evaluation_reports_progress_and_the_same_figures(monkeypatch, capsys):
    from tether.config.agent import AgentEvalConfig, AgentLoopConfig, EnvironmentConfig
    from tether.evaluation import evaluate_agent
    from tether.runtime import progress

    model, tokenizer = build_tiny("tiny", seed=0)
    env, loop = EnvironmentConfig(**ENV), AgentLoopConfig(max_turns=2, max_tokens=40, max_tokens_per_turn=8)
    cfg = AgentEvalConfig(n=6, samples=1, batch_size=4)
    quiet = evaluate_agent(model, tokenizer, env, loop, cfg, progress=False)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    shown = evaluate_agent(model, tokenizer, env, loop, cfg, label="agent eval")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("agent eval:")]
    done = [int(line.split()[2].split("/")[0]) for line in lines]
    assert lines and all("/12 episodes (" in line for line in lines)
    assert done == sorted(done) and done[-1] == 12  # greedy 6 then sampled 6, never going back
    assert dict(shown) == dict(quiet)


def test_agent_ppo_trains_a_critic_on_the_action_tokens(tmp_path):
    """algorithm: ppo (a critic from the policy, GAE, the KL in the reward) with a one-step critic warm-up: the
    run completes and logs the value loss; observation tokens get no advantage and no return; the final
    model is exported with its critic."""
    import json

    cfg = config(algorithm="ppo", critic={"lr": 3e-3, "warmup_steps": 1}, kl={"coef": 0.05}, num_iterations=2,
                 rollout={"group_size": 1}, train={"max_steps": 3, "batch_size": 6, "log_every": 1, "progress": False})
    assert cfg.critic.init == "policy" and cfg.advantage == "gae" and cfg.kl.in_reward
    t = trainer(tmp_path, cfg)
    batches = []
    collect = t.collect
    t.collect = lambda: batches.append(collect()) or batches[-1]
    t.fit()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if m.get("stage") == "agent" and "value/loss" in m]
    assert [m["critic/warmup"] for m in steps] == [1.0, 0.0, 0.0]
    assert all(m["value/loss"] == m["value/loss"] and "policy/loss" in m for m in steps[1:])
    assert all(m["agent/observation_tokens"] > 0 for m in steps)
    for batch in batches:
        observed = torch.tensor([[m == 0 for m in row] + [False] * (batch.mask.shape[1] - len(row))
                                 for row in batch.rollout.action_masks])
        assert observed.any() and (batch.mask[observed] == 0).all()
        assert torch.count_nonzero(batch.advantages[observed]) == 0 and torch.count_nonzero(batch.returns[observed]) == 0
        assert torch.count_nonzero(batch.advantages[batch.mask != 0]) > 0
    assert (tmp_path / "agent" / "value" / "config.json").is_file()  # the critic beside the policy


def test_agent_ppo_on_a_shared_lora_backbone_trains_both_adapters_and_masks_observations(tmp_path):
    """critic.share_backbone: policy and value LoRA adapters on one base model (no reference copy: the
    adapter-free base is the reference). Both adapters learn, the base does not, observation tokens get no
    advantage and no return, and the critic is exported as its adapter and head."""
    from tether.models import apply_lora

    cfg = config(algorithm="ppo", model={"lora": {"r": 4}}, critic={"lr": 3e-3, "share_backbone": True},
                 kl={"coef": 0.05}, num_iterations=2, rollout={"group_size": 1},
                 train={"max_steps": 2, "batch_size": 6, "log_every": 1, "progress": False})
    model, tokenizer = build_tiny("tiny", seed=0)
    torch.manual_seed(0)
    t = AgentRLTrainer(cfg, apply_lora(model, {"r": 4}), tokenizer, tmp_path, reward_functions=[generated_digits])
    assert t.ref_model is None
    start = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    batches = []
    collect = t.collect
    t.collect = lambda: batches.append(collect()) or batches[-1]
    t.fit()
    moved = {n: not torch.equal(start[n], p) for n, p in t.model.named_parameters()}
    assert any(m for n, m in moved.items() if ".value." in n) and any(m for n, m in moved.items() if ".default." in n)
    assert not any(m for n, m in moved.items() if "lora_" not in n and "value_head" not in n)
    for batch in batches:
        observed = torch.tensor([[m == 0 for m in row] + [False] * (batch.mask.shape[1] - len(row))
                                 for row in batch.rollout.action_masks])
        assert observed.any() and torch.count_nonzero(batch.advantages[observed]) == 0
        assert torch.count_nonzero(batch.returns[observed]) == 0
    assert (tmp_path / "agent" / "value" / "adapter_model.safetensors").is_file()


def test_agent_ppo_config_errors_are_clear():
    with pytest.raises(ValueError, match="reads no values"):
        AgentConfig(critic={"init": "policy"})
    with pytest.raises(ValueError, match="needs a critic"):
        AgentConfig(advantage="gae")
    with pytest.raises(ValueError, match="gigpo"):
        AgentConfig(algorithm="ppo", gigpo={})


def test_agent_pass_at_k_counts_tasks_solved_by_any_of_their_k_sampled_episodes(monkeypatch):
    import tether.evaluation as evaluation
    from tether.config.agent import AgentEvalConfig, AgentLoopConfig, EnvironmentConfig
    from tether.rollout.agent import Trajectory, Turn

    # 3 tasks x 4 sampled episodes: task 0 solved twice, task 1 never, task 2 once -> pass@4 = 2/3
    sampled_outcomes = [1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1]

    class ScriptedLoop:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, tasks, params, on_progress=None):
            outcomes = [0.0] * len(tasks) if params.greedy else sampled_outcomes
            return [Trajectory(task=tasks[i // params.n], group=i // params.n, prompt_ids=[1], token_ids=[2],
                               logprobs=[0.0], action_mask=[1], turns=[Turn("finish[0]", kind="final")],
                               turn_spans=[(0, 1)], state_keys=[""], finish_reason="answer", answer="0",
                               outcome=float(o)) for i, o in enumerate(outcomes)]

    monkeypatch.setattr(evaluation, "AgentLoop", ScriptedLoop)
    model, tokenizer = build_tiny("tiny", seed=0)
    figures = evaluation.evaluate_agent(model, tokenizer, EnvironmentConfig(**ENV), AgentLoopConfig(),
                                        AgentEvalConfig(n=3, samples=4), progress=False)
    assert figures["pass@4"] == pytest.approx(2 / 3) and figures["sampled/success"] == pytest.approx(3 / 12)
    assert figures["success"] == 0.0 and figures.outcomes["pass@4"] == [1.0, 0.0, 1.0]
    assert figures["pass@4_ci95_low"] < 2 / 3 < figures["pass@4_ci95_high"]
