"""The multi-turn agent loop: token-in token-out layout, observation masks, budgets, failures and concurrency."""

import math
import re
import threading
import time

import pytest
import torch

from tether.data import tokenize_sft
from tether.models import build_tiny
from tether.rollout import SamplingParams
from tether.rollout.actions import get_action_format
from tether.rollout.agent import (
    AgentLoop,
    AgentLoopConfig,
    AgentRollout,
    ChatRenderer,
    TextRenderer,
    trajectory_metrics,
)
from tether.rollout.environment import EnvironmentConfig, ToolEnvironment, environment_records
from tether.rollout.tools import Tool, build_tools
from tether.tasks import get_task

TOKENIZER = build_tiny()[1]


def solver(prompt_text: str, j: int) -> str:
    """Call the calculator on the question, then answer with the last number observed."""
    if "Action" not in prompt_text:
        return f"Action: calculator[{prompt_text.split('=')[0]}]"
    return f"Action: finish[{re.findall(r'[0-9]+', prompt_text)[-1]}]"


def make_loop(engine, tools=("calculator",), fmt="react", **config):
    tool_map = build_tools(list(tools))
    renderer = ChatRenderer(TOKENIZER, get_action_format(fmt), [t.schema for t in tool_map.values()],
                            system_prompt=False)
    task = get_task("multiplication", digits=3, tools=["calculator"])
    def make_env():
        return ToolEnvironment(task, tool_map, get_action_format(fmt))
    return AgentLoop(engine, TOKENIZER, make_env, renderer, AgentLoopConfig(**config))


def records(n=3):
    return environment_records(EnvironmentConfig(task={"name": "multiplication", "options": {"tools": ["calculator"]}}),
                               split="train", n=n)


class StopStringEngine:
    """A scripted engine that honours stop strings as the real engines do: a sample whose text holds one
    ends with the first token that completes it (whole: with a BPE tokenizer it may carry more characters)
    and its text is cut right after the stop string; any other sample ends with EOS. ``stops`` records the
    stop strings of every call."""

    def __init__(self, script, tokenizer=TOKENIZER):
        self.script, self.tokenizer, self.stops = script, tokenizer, []

    def generate(self, prompts, params):
        from tether.rollout import Rollout

        self.stops.append(list(params.stop))
        stop = list(params.stop or ())
        texts = [self.script(self.tokenizer.decode(p, skip_special_tokens=True), j)
                 for p in prompts for j in range(params.n)]
        ids = []
        for k, text in enumerate(texts):
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ends = [n for n in range(1, len(tokens) + 1) if any(s in self.tokenizer.decode(tokens[:n]) for s in stop)]
            if ends:
                tokens = tokens[: ends[0]]
                text = self.tokenizer.decode(tokens)
                texts[k] = text[: min(text.find(s) + len(s) for s in stop if s in text)]
            ids.append(tokens if ends else [*tokens, self.tokenizer.eos_token_id])
        index = [i for i in range(len(prompts)) for _ in range(params.n)]
        return Rollout(prompt_ids=[list(prompts[i]) for i in index], completion_ids=ids,
                       completion_logprobs=[[0.0] * len(c) for c in ids], finish_reasons=["stop"] * len(texts),
                       prompt_index=index, texts=texts)


def text_solver(context: str, j: int) -> str:
    """ReAct in plain text: call the calculator on the question, then answer with the last observation."""
    if "Action" not in context:
        question = context.split("Question: ", 1)[1]
        return f"Thought: compute it.\nAction: calculator[{question.split('=')[0].strip()}]\nObservation:"
    answer = re.findall(r"Observation:\s*([0-9]+)", context)[-1]
    return f"Action: finish[{answer}]"


def text_loop(engine, tokenizer=TOKENIZER, **config):
    tool_map = build_tools(["calculator"])
    renderer = TextRenderer(tokenizer, get_action_format("react"), [t.schema for t in tool_map.values()],
                            system_prompt=False)
    task = get_task("multiplication", digits=3, tools=["calculator"])
    return AgentLoop(engine, tokenizer, lambda: ToolEnvironment(task, tool_map, get_action_format("react")),
                     renderer, AgentLoopConfig(**config))


@pytest.mark.parametrize("tokenizer", ["character", "bpe"])
def test_text_rendering_is_plain_react_token_for_token_the_sft_segments(tokenizer, request):
    """rendering: text (no chat template): each turn stops on the 'Observation:' the policy writes, the tool's
    output follows as observation tokens, and the episode is token for token the SFT segments record of the
    same episode, with loss exactly on the policy's tokens; with the built-in character tokenizer and with a
    byte-level BPE one, whose tokens span several characters (each segment is tokenised on its own on both
    sides, so no token crosses a boundary between the policy's text and the environment's)."""
    tokenizer = TOKENIZER if tokenizer == "character" else request.getfixturevalue("bpe_tokenizer")
    engine = StopStringEngine(text_solver, tokenizer)
    loop = text_loop(engine, tokenizer)
    trajectories = loop.run(records(), SamplingParams(n=2, seed=0))
    assert all(stop == ["Observation:"] for stop in engine.stops)
    for t in trajectories:
        assert t.outcome == 1.0 and [turn.kind for turn in t.turns] == ["tool", "final"]
        text = tokenizer.decode(t.prompt_ids + t.token_ids, skip_special_tokens=False)
        assert text == (f"<s>Question: {t.task['prompt']}\nThought: compute it.\nAction: calculator["
                        f"{t.task['prompt'].split('=')[0].strip()}]\nObservation: {t.task['answer']}\n"
                        f"Action: finish[{t.task['answer']}]</s>")
        turns = [(t.turns[0].text.removesuffix("\nObservation:"), t.turns[0].observation), (t.turns[1].text, None)]
        example = tokenize_sft(loop.renderer.demonstration(t.task["prompt"], turns), tokenizer, max_length=512)
        assert t.prompt_ids + t.token_ids == example.input_ids
        assert t.action_mask == [int(label != -100) for label in example.labels[len(t.prompt_ids):]]


def test_a_bpe_token_that_carries_past_the_stop_string_stays_the_policys(bpe_tokenizer):
    """With a BPE tokenizer the token that completes 'Observation:' may carry more (":\n" here): the turn still
    ends there, the action is parsed without the stop string, that whole token stays the policy's (loss on it),
    and the observation tokens follow it unchanged."""
    def run_on(context: str, j: int) -> str:  # writes past the stop string, as a model does
        return text_solver(context, j) + ("\n 12345" if "Action" not in context else "")

    loop = text_loop(StopStringEngine(run_on, bpe_tokenizer), bpe_tokenizer)
    for t in loop.run(records(2), SamplingParams(seed=0)):
        assert t.outcome == 1.0 and [turn.kind for turn in t.turns] == ["tool", "final"]
        pieces = [bpe_tokenizer.decode([i]) for i in t.token_ids]
        colon = pieces.index(":\n")
        assert pieces[colon - 1] == "Observation" and t.action_mask[colon] == 1
        observed = [i for i, m in zip(t.token_ids, t.action_mask, strict=True) if m == 0]
        assert observed == bpe_tokenizer.encode(f" {t.task['answer']}\n", add_special_tokens=False)
        assert t.token_ids[colon + 1 : colon + 1 + len(observed)] == observed
        assert t.turns[0].text.endswith("]\nObservation:")


def test_text_rendering_gives_a_turn_that_did_not_stop_the_whole_observation_line():
    """A turn that ends without writing 'Observation:' (here: EOS after a malformed action) gets the
    '\nObservation: ' prefix as observation tokens, and the environment parses a turn without the stop string."""
    loop = text_loop(StopStringEngine(lambda context, j: "no action here"), max_turns=2)
    t = loop.run(records(1), SamplingParams(seed=0))[0]
    assert [turn.kind for turn in t.turns] == ["malformed", "malformed"]
    observed = TOKENIZER.decode([i for i, m in zip(t.token_ids, t.action_mask, strict=True) if m == 0])
    assert observed.startswith("\nObservation: Error") and observed.endswith("\n")
    assert loop.renderer.action_text("Action: finish[3]\nObservation:") == "Action: finish[3]\n"


def test_observation_tokens_come_from_the_chat_template():
    renderer = ChatRenderer(TOKENIZER, get_action_format("react"), [], system_prompt=False)
    ids = renderer.observation_ids("42", ended_turn=True)
    assert TOKENIZER.decode(ids) == "<|tool|>42</s><|assistant|>"
    assert renderer.observation_ids("42", ended_turn=False) == [TOKENIZER.eos_token_id, *ids]


def test_trajectory_is_token_for_token_the_sft_conversation(scripted_engine):
    """The episode's tokens equal the SFT tokenisation of the same conversation, and its action mask
    is exactly where SFT puts loss: the assistant turns with their end-of-turn token."""
    loop = make_loop(scripted_engine(TOKENIZER, solver))
    tasks = records()
    trajectories = loop.run(tasks, SamplingParams(n=2, seed=0))
    assert len(trajectories) == 6
    for t in trajectories:
        assert t.outcome == 1.0 and t.finish_reason == "answer" and [turn.kind for turn in t.turns] == ["tool", "final"]
        messages = loop.renderer.messages(t.task["prompt"], [(turn.text, turn.observation) for turn in t.turns])
        example = tokenize_sft({"messages": messages}, TOKENIZER, max_length=512)
        assert t.prompt_ids + t.token_ids == example.input_ids
        trained = [int(label != -100) for label in example.labels[len(t.prompt_ids):]]
        assert t.action_mask == trained
        assert all(math.isnan(lp) for lp, m in zip(t.logprobs, t.action_mask, strict=True) if m == 0)  # not sampled
        assert t.observation_tokens == len(TOKENIZER.encode(f"<|tool|>{t.task['answer']}</s><|assistant|>",
                                                            add_special_tokens=False))


def test_agent_rollout_masks_observations_and_keeps_them_through_select_and_concat(scripted_engine):
    trajectories = make_loop(scripted_engine(TOKENIZER, solver)).run(records(2), SamplingParams(n=2, seed=0))
    rollout = AgentRollout.from_trajectories(trajectories, ["" for _ in trajectories])
    padded = rollout.to_padded(TOKENIZER.pad_token_id)
    for i, t in enumerate(trajectories):
        mask = padded["completion_mask"][i, : len(t.token_ids)]
        assert mask.tolist() == t.action_mask and padded["completion_mask"][i, len(t.token_ids):].sum() == 0
    assert rollout.prompt_index == [0, 0, 1, 1]
    picked = AgentRollout.concat([rollout.select([2, 3]), rollout.select([0])])
    assert isinstance(picked, AgentRollout) and picked.prompt_index == [0, 0, 1]
    assert torch.equal(picked.to_padded(0)["completion_mask"][2], padded["completion_mask"][0])


def test_malformed_actions_become_error_observations(scripted_engine):
    def sloppy(prompt_text, j):
        if "Error" not in prompt_text:
            return "the answer is probably big"
        if "Action: calculator" not in prompt_text:
            return f"Action: calculator[{prompt_text.split('=')[0]}]"
        return f"Action: finish[{re.findall(r'[0-9]+', prompt_text)[-1]}]"

    (t,) = make_loop(scripted_engine(TOKENIZER, sloppy), max_turns=4).run(records(1), SamplingParams(n=1))
    assert [turn.kind for turn in t.turns] == ["malformed", "tool", "final"]
    assert t.turns[0].observation.startswith("Error: no action") and t.outcome == 1.0
    metrics = trajectory_metrics([t])
    assert metrics["malformed_rate"] == pytest.approx(1 / 3) and metrics["tool_calls"] == 1


def test_turn_and_token_budgets_end_episodes(scripted_engine):
    looping = scripted_engine(TOKENIZER, lambda text, j: "Action: calculator[1+1]")
    (t,) = make_loop(looping, max_turns=3).run(records(1), SamplingParams(n=1))
    assert t.finish_reason == "max_turns" and len(t.turns) == 3 and t.answer is None and t.outcome == 0.0
    (t,) = make_loop(looping, max_turns=10, max_tokens=60).run(records(1), SamplingParams(n=1))
    assert t.finish_reason == "max_tokens" and len(t.token_ids) <= 60 and t.outcome == 0.0
    verbose = scripted_engine(TOKENIZER, lambda text, j: "x" * 200)
    (t,) = make_loop(verbose, max_tokens=50, max_tokens_per_turn=100).run(records(1), SamplingParams(n=1))
    assert t.finish_reason == "max_tokens" and len(t.token_ids) == 50 and t.turns[-1].kind == "truncated"


def test_tool_failures_and_sandbox_limits_are_counted(scripted_engine):
    def attacker(text, j):
        return "Action: python[import time; time.sleep(30)]" if "Action" not in text else "Action: finish[0]"

    loop = make_loop(scripted_engine(TOKENIZER, attacker), tools=[{"name": "python",
                                                                   "kwargs": {"limits": {"wall_s": 0.5}}}])
    (t,) = loop.run(records(1), SamplingParams(n=1))
    assert t.turns[0].observation.startswith("Error: limit hit: wall") and t.finish_reason == "answer"
    metrics = trajectory_metrics([t])
    assert metrics["tool_failure_rate"] == 1.0 and metrics["limit/wall"] == 1.0 and metrics["limits_hit"] == 1.0


def test_slow_tools_do_not_block_the_other_episodes(scripted_engine):
    """With ``tool_wait_s`` set, episodes whose tool returned go on generating while one tool call sleeps."""
    release = threading.Event()
    finished_while_blocked = []

    def slow(expression: str) -> str:
        """Evaluate slowly when asked to.

        Args:
            expression: an expression.
        """
        if expression == "slow":
            release.wait(10)
        return "7"

    def script(text, j):
        if "Action" not in text:
            return "Action: slow[slow]" if text.startswith(first_prompt) else "Action: slow[fast]"
        return "Action: finish[7]"

    tasks = records(3)
    first_prompt = tasks[0]["prompt"].split("=")[0]
    engine = scripted_engine(TOKENIZER, script)
    original = engine.generate

    def generate(prompts, params):
        out = original(prompts, params)
        if len(prompts) == 2 and not release.is_set():  # the two fast episodes' final turns
            finished_while_blocked.append(True)
            release.set()
        return out

    engine.generate = generate
    loop = make_loop(engine, tools=[Tool(slow)], tool_wait_s=0.01)
    start = time.monotonic()
    trajectories = loop.run(tasks, SamplingParams(n=1))
    assert finished_while_blocked == [True] and time.monotonic() - start < 5
    assert all(t.finish_reason == "answer" for t in trajectories)


def test_episode_records_pair_successes_with_failures_token_for_token(scripted_engine):
    """Sample 0 of each task solves it with the calculator, sample 1 guesses: each prompt gives one pair whose
    chosen tokenises to exactly the successful trajectory's tokens (prompt + interleaved turns)."""
    from tether.data.episode_pairs import episode_pairs
    from tether.rollout.agent import episode_record

    def script(text, j):
        return "Action: finish[0]" if j == 1 else solver(text, j)

    loop = make_loop(scripted_engine(TOKENIZER, script))
    trajectories = loop.run(records(2), SamplingParams(n=2, seed=0))
    episodes = [episode_record(t, loop.renderer) for t in trajectories]
    assert [e["outcome"] for e in episodes] == [1.0, 0.0, 1.0, 0.0]
    pairs, stats = episode_pairs(episodes)
    assert stats["pairs"] == 2 and stats["prompts"] == 2
    for pair, won in zip(pairs, trajectories[::2], strict=True):
        assert [m["role"] for m in pair["chosen"]] == ["assistant", "tool", "assistant"]
        assert pair["rejected"] == [{"role": "assistant", "content": "Action: finish[0]"}]
        example = tokenize_sft({"prompt": pair["prompt"], "completion": pair["chosen"]}, TOKENIZER, max_length=512)
        assert example.input_ids == won.prompt_ids + won.token_ids
