"""The multi-turn agent loop, token in, token out, with observation tokens masked.

One episode (ReAct, Yao et al. 2023; the tool-call layout of Toolformer, Schick et al. 2023, in
chat form): the environment's first observation becomes the prompt through the chat template;
then, up to ``max_turns`` times, the policy generates one turn (until its end-of-turn token), the
environment acts on it (runs the tool call, or reports a malformed action as an error
observation, or accepts the final answer), and the observation is appended as the template's
tool message followed by the next assistant header. The trajectory is the prompt and one token
sequence interleaving the policy's sampled tokens (``action_mask`` 1, with their sampling
log-probs) and the observation tokens (``action_mask`` 0), capped at ``max_tokens`` in all.

Token in, token out: the sampled ids are kept exactly (never re-tokenised from text); only the
observations are tokenised, as the difference between the template rendered with and without
the tool message, so a trajectory is token for token what SFT on the same conversation trains on.

``environment.rendering: text`` (:class:`TextRenderer`) lays the episode out as one plain ReAct text
instead, for models without a chat template: turns stop on the ``Observation:`` string the policy
writes, and demonstrations become ``segments`` records tokenised piece by piece as the loop appends them.

Many episodes run together: each round generates one turn for every episode that is ready in one
batched ``generate`` call, and tool calls run on a thread pool. ``tool_wait_s: null`` (default)
waits for every tool call before the next round, which keeps rounds, and so seeded samples,
reproducible; a number lets episodes whose tools are slower than that join a later round, so
slow tools do not hold up generation for the others.

``AgentRollout`` packs finished trajectories as a :class:`~tether.rollout.base.Rollout` whose
"completion" is the interleaved sequence and whose ``to_padded()["completion_mask"]`` is 0 on
observation tokens, so an RL trainer's loss, KL and advantages see only the policy's own tokens.
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.config.agent import AgentLoopConfig, EnvironmentConfig
from tether.data.tokenize import encode_text, tokenize_prompt
from tether.rollout.actions import ActionFormat
from tether.rollout.base import GenerationEngine, Rollout, SamplingParams
from tether.rollout.environment import Environment, environment_factory, environment_records
from tether.rollout.tools import build_tools

_MARK = "\x00TETHER-ASSISTANT\x00"
_OBS = "\x00TETHER-OBSERVATION\x00"


@dataclass
class Turn:
    """One policy turn and what the environment made of it."""

    text: str
    kind: str = "pending"  # tool | final | malformed | truncated
    observation: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode. ``token_ids`` interleaves generated (``action_mask`` 1) and observation (0) tokens;
    ``turn_spans[t]`` is the [start, end) of turn ``t``'s generated tokens in it; ``state_keys[t]`` the
    environment state before turn ``t``; ``outcome`` the verifier's score; ``observation`` the environment's
    first observation (the prompt's text)."""

    task: dict
    group: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    state_keys: list[str] = field(default_factory=list)
    finish_reason: str = "running"  # answer | max_turns | max_tokens
    answer: str | None = None
    outcome: float = 0.0
    observation: str = ""

    @property
    def generated_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def observation_tokens(self) -> int:
        return len(self.action_mask) - sum(self.action_mask)

    @property
    def step_rewards(self) -> list[float]:
        return [float(t.info.get("reward", 0.0)) for t in self.turns]


class ChatRenderer:
    """Prompt and observation tokens through the tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any, action_format: ActionFormat, schemas: list[dict], *,
                 system_prompt: bool = True) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the agent loop needs a tokenizer with a chat template")
        self.tokenizer, self.format, self.schemas = tokenizer, action_format, schemas
        template_tools = "tools" in tokenizer.chat_template
        self.template_tools = schemas if (template_tools and system_prompt and schemas) else None
        self.system = action_format.describe(schemas) if system_prompt and not self.template_tools else None
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        closed = self._render(base, generation_prompt=False)
        with_tool = self._render([*base, {"role": "tool", "content": _OBS}], generation_prompt=True)
        if not with_tool.startswith(closed) or _OBS not in with_tool:
            raise ValueError("the chat template does not render a tool message after an assistant turn "
                             "as an appended suffix; cannot build observation tokens")
        self.turn_close = encode_text(self.tokenizer, closed.split(_MARK, 1)[1])
        self.observation_parts = with_tool[len(closed):].split(_OBS, 1)
        self.eos = tokenizer.eos_token_id

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.template_tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def first_messages(self, observation: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": observation}]

    def prompt_ids(self, observation: str) -> list[int]:
        return tokenize_prompt(self.first_messages(observation), self.tokenizer, tools=self.template_tools)

    def observation_ids(self, observation: str, ended_turn: bool) -> list[int]:
        """Tokens after a policy turn: the rest of the turn's closing (all of it if the turn did not end
        with EOS), the tool message, and the next assistant header."""
        close = self.turn_close
        if ended_turn and close and close[0] == self.eos:
            close = close[1:]
        before, after = self.observation_parts
        return close + encode_text(self.tokenizer, before + observation + after)

    def messages(self, observation: str, turns: Sequence[tuple[str, str | None]]) -> list[dict]:
        """The conversation of an episode, for SFT: tool messages are not trained on."""
        messages = self.first_messages(observation)
        for action, result in turns:
            messages.append({"role": "assistant", "content": action})
            if result is not None:
                messages.append({"role": "tool", "content": result})
        return messages

    stop: tuple[str, ...] = ()  # a turn ends at the end-of-turn token

    def turn_ended(self, token_ids: Sequence[int], text: str) -> bool:
        """Whether the policy closed its turn itself (here: with the end-of-turn token)."""
        return bool(token_ids) and token_ids[-1] == self.eos

    def action_text(self, text: str) -> str:
        """The part of a turn's text the environment parses."""
        return text

    def demonstration(self, observation: str, turns: Sequence[tuple[str, str | None]]) -> dict:
        """An SFT record of a scripted episode: a chat record (with ``tools`` when the template lists them)."""
        record = {"messages": self.messages(observation, turns)}
        return {**record, "tools": self.template_tools} if self.template_tools else record


class TextRenderer:
    """ReAct as one plain text (Yao et al. 2023's layout), for models without a chat template
    (``environment.rendering: text``)::

        [the tools' description]            (with ``system_prompt``)
        Question: <the first observation>
        <the policy's turn: Thought: ... Action: tool[input]>
        Observation: <the tool's output>
        <the next turn> ... Action: finish[answer]<eos>

    The policy writes ``Observation:`` itself and its turn stops on that string (the engine's stop
    string); the environment parses the turn without it and the observation tokens are the output after
    it. A turn that ends otherwise (its token budget, or EOS without a final answer) gets the whole
    ``\\nObservation: ...`` line as observation tokens. Every piece is tokenised on its own, as the loop
    appends it, so SFT on :meth:`demonstration` segments trains on the tokens the loop builds."""

    stop: tuple[str, ...] = ("Observation:",)
    template_tools = None

    def __init__(self, tokenizer: Any, action_format: ActionFormat, schemas: list[dict], *,
                 system_prompt: bool = True) -> None:
        self.tokenizer = tokenizer
        self.header = action_format.describe(schemas) + "\n\n" if system_prompt and schemas else ""

    def prompt_text(self, observation: str) -> str:
        return f"{self.header}Question: {observation}\n"

    def prompt_ids(self, observation: str) -> list[int]:
        return tokenize_prompt(self.prompt_text(observation), self.tokenizer)

    def turn_ended(self, token_ids: Sequence[int], text: str) -> bool:
        return text.endswith(self.stop)

    def action_text(self, text: str) -> str:
        return text[: -len(self.stop[0])] if text.endswith(self.stop) else text

    def observation_text(self, observation: str, ended_turn: bool) -> str:
        return (" " if ended_turn else "\nObservation: ") + observation + "\n"

    def observation_ids(self, observation: str, ended_turn: bool) -> list[int]:
        return encode_text(self.tokenizer, self.observation_text(observation, ended_turn))

    def demonstration(self, observation: str, turns: Sequence[tuple[str, str | None]]) -> dict:
        """An SFT ``segments`` record: the prompt and the observations without loss, the turns (each tool
        call closed by the ``Observation:`` the policy writes) with it, then EOS."""
        segments = [{"text": self.prompt_text(observation), "loss": False}]
        for action, result in turns:
            if result is None:
                segments.append({"text": action, "loss": True})
            else:
                segments += [{"text": f"{action}\n{self.stop[0]}", "loss": True},
                             {"text": self.observation_text(result, True), "loss": False}]
        return {"segments": segments}


@dataclass
class AgentRollout(Rollout):
    """A :class:`Rollout` of trajectories: completion = generated and observation tokens interleaved.

    ``to_padded()["completion_mask"]`` is 1 only on the policy's tokens (``action_masks``); the
    per-trajectory record is in ``trajectories``.
    """

    action_masks: list[list[int]] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], texts: list[str]) -> AgentRollout:
        groups: dict[int, int] = {}
        index = [groups.setdefault(t.group, len(groups)) for t in trajectories]
        return cls(prompt_ids=[list(t.prompt_ids) for t in trajectories],
                   completion_ids=[list(t.token_ids) for t in trajectories],
                   completion_logprobs=[list(t.logprobs) for t in trajectories],
                   finish_reasons=["length" if t.finish_reason == "max_tokens" else "stop" for t in trajectories],
                   prompt_index=index, texts=texts, action_masks=[list(t.action_mask) for t in trajectories],
                   trajectories=list(trajectories))

    def to_padded(self, pad_id: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        out = super().to_padded(pad_id)
        mask = out["completion_mask"]
        for i, action in enumerate(self.action_masks):
            mask[i, : len(action)] *= torch.tensor(action, dtype=mask.dtype)
        return out if device is None else {k: v.to(device) for k, v in out.items()}

    def select(self, indices: Sequence[int]) -> AgentRollout:
        indices = list(indices)
        base = super().select(indices)
        return AgentRollout(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Rollout)},
                            action_masks=[self.action_masks[i] for i in indices],
                            trajectories=[self.trajectories[i] for i in indices])

    @staticmethod
    def concat(rollouts: Sequence[AgentRollout]) -> AgentRollout:
        base = Rollout.concat(rollouts)
        return AgentRollout(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Rollout)},
                            action_masks=[m for r in rollouts for m in r.action_masks],
                            trajectories=[t for r in rollouts for t in r.trajectories])


class AgentLoop:
    """Runs episodes of an environment with a generation engine; see the module docstring."""

    def __init__(self, engine: GenerationEngine, tokenizer: Any, make_env: Callable[[], Environment],
                 renderer: ChatRenderer | TextRenderer, config: AgentLoopConfig | None = None) -> None:
        self.engine, self.tokenizer, self.make_env, self.renderer = engine, tokenizer, make_env, renderer
        self.config = config or AgentLoopConfig()

    def run(self, tasks: list[dict], params: SamplingParams,
            on_progress: Callable[[int], None] | None = None) -> list[Trajectory]:
        """``params.n`` episodes per task (contiguous), each verified; ``params.max_new_tokens`` is ignored
        in favour of ``max_tokens_per_turn`` and the episode budget. ``on_progress(finished)`` is called after
        every turn with the number of episodes that have ended (progress reporting only)."""
        envs, trajectories = [], []
        for g, task in enumerate(tasks):
            for _ in range(params.n):
                env = self.make_env()
                envs.append(env)
                first = env.reset(task)
                trajectories.append(Trajectory(task=task, group=g, prompt_ids=self.renderer.prompt_ids(first),
                                               observation=first))
        ready, pending, round_index = list(range(len(trajectories))), {}, 0
        with futures.ThreadPoolExecutor(self.config.tool_workers) as pool:
            while ready or pending:
                if ready:
                    ready.sort()  # tool calls finish in any order; batch rows (and so samples) must not
                    for i, (ids, logps, text, stopped) in zip(
                            ready, self._generate(trajectories, envs, ready, params, round_index), strict=True):
                        if self._append_turn(trajectories[i], ids, logps, text, stopped):
                            pending[pool.submit(envs[i].step, self.renderer.action_text(text))] = i
                    ready, round_index = [], round_index + 1
                for done in self._collect(pending):
                    i = pending.pop(done)
                    if self._apply_step(trajectories[i], *done.result()):
                        ready.append(i)
                if on_progress is not None:
                    on_progress(len(trajectories) - len(ready) - len(pending))
            scores = list(pool.map(lambda k: envs[k].verify(trajectories[k], trajectories[k].task),
                                   range(len(trajectories))))
        for trajectory, score in zip(trajectories, scores, strict=True):
            trajectory.outcome = float(score)
        return trajectories

    def _collect(self, pending: dict) -> set:
        if not pending:
            return set()
        wait = self.config.tool_wait_s
        done, _ = futures.wait(pending, timeout=wait, return_when=futures.ALL_COMPLETED)
        if not done:  # nothing is ready to generate: block for the first result
            done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
        return done

    def _generate(self, trajectories: list[Trajectory], envs: list, ready: list[int], params: SamplingParams,
                  round_index: int) -> list[tuple[list[int], list[float], str, bool]]:
        """One turn for every ready episode, in one ``generate`` call (the first turn: one prompt per group)."""
        budget = max(self.config.max_tokens - len(trajectories[i].token_ids) for i in ready)
        seed = None if params.seed is None else params.seed + 7919 * round_index
        turn = dataclasses.replace(params, max_new_tokens=min(self.config.max_tokens_per_turn, budget), seed=seed,
                                   stop=list(self.renderer.stop))
        for i in ready:
            trajectories[i].state_keys.append(envs[i].state_key())
        first = round_index == 0 and len(ready) == len(trajectories)
        if first:
            group_starts = ready[:: params.n]
            out = self.engine.generate([trajectories[i].prompt_ids for i in group_starts], turn)
        else:
            contexts = [trajectories[i].prompt_ids + trajectories[i].token_ids for i in ready]
            out = self.engine.generate(contexts, dataclasses.replace(turn, n=1))
        return [(ids, lps, text, reason == "stop") for ids, lps, text, reason in
                zip(out.completion_ids, out.completion_logprobs, out.texts, out.finish_reasons, strict=True)]

    def _append_turn(self, trajectory: Trajectory, ids: list[int], logprobs: list[float], text: str,
                     stopped: bool) -> bool:
        """Add a generated turn; False when the episode's token budget ends it (no environment step)."""
        room = self.config.max_tokens - len(trajectory.token_ids)
        cut = len(ids) > room
        ids, logprobs = ids[:room], logprobs[:room]
        start = len(trajectory.token_ids)
        trajectory.token_ids += ids
        trajectory.logprobs += logprobs
        trajectory.action_mask += [1] * len(ids)
        trajectory.turn_spans.append((start, len(trajectory.token_ids)))
        if cut:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        trajectory.turns.append(Turn(text=text))
        if cut or (not stopped and len(trajectory.token_ids) >= self.config.max_tokens):
            trajectory.turns[-1].kind = "truncated"
            trajectory.finish_reason = "max_tokens"
            return False
        return True

    def _apply_step(self, trajectory: Trajectory, observation: str | None, done: bool, info: dict) -> bool:
        """Record the environment's answer to the last turn; True when the episode continues."""
        turn = trajectory.turns[-1]
        turn.kind, turn.observation, turn.info = info.get("kind", "tool"), observation, info
        if done:
            trajectory.answer, trajectory.finish_reason = info.get("answer"), "answer"
            return False
        if len(trajectory.turns) >= self.config.max_turns:
            trajectory.finish_reason = "max_turns"
            return False
        start, end = trajectory.turn_spans[-1]
        ended = self.renderer.turn_ended(trajectory.token_ids[start:end], turn.text)
        obs_ids = self.renderer.observation_ids(observation or "", ended)
        if len(trajectory.token_ids) + len(obs_ids) >= self.config.max_tokens:
            trajectory.finish_reason = "max_tokens"
            return False
        trajectory.token_ids += obs_ids
        trajectory.logprobs += [math.nan] * len(obs_ids)  # not sampled: no sampler log-prob
        trajectory.action_mask += [0] * len(obs_ids)
        return True


def trajectory_metrics(trajectories: Sequence[Trajectory], success_threshold: float = 1.0) -> dict[str, float]:
    """Turns, tool calls, tool failure rate, malformed actions, limits hit, success, tokens generated vs
    observed, and how episodes ended; means over trajectories unless named a rate."""
    n = max(len(trajectories), 1)
    turns = [turn for t in trajectories for turn in t.turns]
    calls = sum(len(turn.info.get("tools", [])) for turn in turns)
    failures = sum(turn.info.get("tool_errors", 0) for turn in turns)
    limits = [limit for turn in turns for limit in turn.info.get("limits", [])]
    out = {
        "success": sum(t.outcome >= success_threshold for t in trajectories) / n,
        "score": sum(t.outcome for t in trajectories) / n,
        "turns": len(turns) / n,
        "tool_calls": calls / n,
        "tool_failure_rate": failures / max(calls, 1),
        "malformed_rate": sum(turn.kind == "malformed" for turn in turns) / max(len(turns), 1),
        "limits_hit": len(limits) / n,
        "generated_tokens": sum(t.generated_tokens for t in trajectories) / n,
        "observation_tokens": sum(t.observation_tokens for t in trajectories) / n,
    }
    for reason in ("answer", "max_turns", "max_tokens"):
        out[f"finish/{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    for limit in sorted(set(limits)):
        out[f"limit/{limit}"] = limits.count(limit) / n
    return out


def trajectory_texts(trajectories: Sequence[Trajectory], tokenizer: Any) -> list[str]:
    """Each trajectory's interleaved tokens decoded with the template's role markers kept (for logs)."""
    return tokenizer.batch_decode([t.token_ids for t in trajectories], skip_special_tokens=False)


def episode_record(trajectory: Trajectory, renderer: ChatRenderer) -> dict:
    """A finished episode as ``{"prompt": [messages], "completion": [assistant / tool messages], "outcome"}``
    (with ``tools`` when the template lists them), for :func:`tether.data.episode_pairs.episode_pairs`. The
    completion is the conversation the trajectory's tokens render: a last observation no turn answered
    (the episode hit ``max_turns``) is left out."""
    last = len(trajectory.turns) - 1
    turns = [(t.text, t.observation if i < last else None) for i, t in enumerate(trajectory.turns)]
    prompt = renderer.first_messages(trajectory.observation)
    record = {"prompt": prompt, "completion": renderer.messages(trajectory.observation, turns)[len(prompt):],
              "outcome": trajectory.outcome}
    return {**record, "tools": renderer.template_tools} if renderer.template_tools else record


def environment_renderer(env: EnvironmentConfig, tokenizer: Any
                         ) -> tuple[Callable[[], Environment], ChatRenderer | TextRenderer]:
    """A factory of fresh environments for ``env`` and the renderer of its turns for ``tokenizer``
    (``env.rendering``: the chat template, or ReAct's plain text)."""
    from tether.rollout.actions import get_action_format

    tools = build_tools(env.tools)
    renderer = (TextRenderer if env.rendering == "text" else ChatRenderer)(
        tokenizer, get_action_format(env.action_format), [t.schema for t in tools.values()],
        system_prompt=env.system_prompt)
    return environment_factory(env), renderer


def demonstration_records(env: EnvironmentConfig, tokenizer: Any, n: int | None = None,
                          seed: int | None = None, workers: int = 4) -> list[dict]:
    """SFT records of scripted episodes (tools run for real, ``workers`` at a time), rendered exactly as
    the agent loop renders prompts and observations: chat records ``{"messages": [...]}`` whose tool
    messages carry no loss, or with ``rendering: text`` ``{"segments": [...]}`` whose observations carry none."""
    make_env, renderer = environment_renderer(env, tokenizer)

    def record(task: dict) -> dict:
        environment = make_env()
        first = environment.reset(task)
        return renderer.demonstration(first, environment.demonstration(task))

    with futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(record, environment_records(env, split="train", n=n, seed=seed)))
