"""``sampler=agentflow`` (``env=agentflow``): AgentFlow's four-module agent, only the planner trained.

Paper: "In-the-Flow Agentic System Optimization for Effective Planning and Tool Use" (AgentFlow,
Li, Zhang, Han, ..., Zou, Lu; arXiv:2510.05592); authors' code https://github.com/lupantech/AgentFlow
(``agentflow/agentflow/solver.py``, ``models/{planner,executor,verifier,memory}.py``,
``agentflow/verl/daemon.py``), which we followed where the text is silent.

One episode (the authors' ``Solver.solve``), per prompt and rollout:

1. **query analysis** by the fixed engine (the authors' ``Planner.analyze_query`` runs on the
   planner's *fixed* engine);
2. for ``t = 1 .. max_steps``:

   a. the **planner** (the trained policy) reads the query, the analysis, the tools and the
      memory and names the next step as ``Context: ... Sub-Goal: ... Tool Name: ...``
      (:func:`parse_plan`);
   b. the **executor** (fixed engine) turns the sub-goal and context into one
      ``<tool_call>`` for the planner's tool, which rlpost's tool registry runs
      (``rlpost.envs.tools``; an unknown tool runs nothing, as in the authors' code);
   c. the **memory** records ``(tool, sub-goal, command, result)`` under ``Action Step t``
      (:class:`AgentMemory`);
   d. the **verifier** (fixed engine) reads the memory and ends with ``Conclusion: STOP`` or
      ``CONTINUE`` (:func:`parse_conclusion`); STOP ends the loop. At ``t = max_steps`` the loop
      ends anyway, so the verifier is not called there (its verdict could change nothing);

3. the **generator** (fixed engine) writes the final answer from the query, analysis and memory;
   the task's verifier scores it: the episode's one outcome ``R``.

**Rows: one per planner turn** ("multi-turn optimisation as a sequence of single-turn updates"; the
authors' daemon turns every call of the trainable engine into its own training sample). A row's
prompt is the planner prompt of that turn (with the memory as it stood), its response the planner's
sampled tokens, loss mask 1 on all of them; nothing the fixed modules wrote is in any row's
response, so **only planner tokens carry loss**. Every row of an episode gets the episode's reward
(Flow-GRPO's broadcast of the trajectory outcome to every turn); ``algo=flow_grpo``
(:mod:`rlpost.algos.flow_grpo`) group-normalises it.

**The fixed engine** (``fixed_model``): in the authors' training config the planner is the
trainable model and every other module a fixed LLM (``MODEL_ENGINE: [trainable, gpt-4o-mini,
gpt-4o-mini, gpt-4o-mini]``). Here ``""`` (default) is a frozen copy of the policy taken at the first
:meth:`AgentFlowSampler.sample` (the starting weights; on a resumed run, the weights at resume: our
choice, the copy is not checkpointed); ``policy`` uses the live policy engine for those calls (never
trained); any other value is a model preset or directory loaded frozen, as ``model.teacher`` is.

Prompts are ours, written after the authors' module prompts (same inputs, same answer formats), kept
short for small models. All modules sample with the step's sampling parameters (the authors pass the
one training temperature to every engine); each module call is one engine call for all live episodes.

Shapes of :class:`rlpost.samplers.base.SampleResult` (``B`` = planner turns of the step):
``extras['flow_episode']`` ``[B]`` long (episode id within the step), ``extras['flow_turn']``
``[B]`` long (planner turn, 0-based), ``extras['episode_final_row']`` ``[B]`` bool (the last planner
turn of its episode; held-out evaluation keeps these rows, one per problem),
``extras['episode_turns']`` / ``extras['episode_tool_calls']`` ``[B]`` float (of the row's episode).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.registry import param
from rlpost.envs.tools import ToolCall, build_tools, call_tool, parse_tool_calls
from rlpost.rollout.base import GenerationResult
from rlpost.rollout.hf import left_pad
from rlpost.samplers.base import SAMPLERS, Sampler, pad_id_of, step_params
from rlpost.tasks.chat import encode_plain, encode_framed, template_parts

PAPER = "In-the-Flow Agentic System Optimization for Effective Planning and Tool Use (AgentFlow, arXiv:2510.05592)"
#: the modules the fixed engine runs (the planner is the policy)
FIXED_MODULES = ("analysis", "executor", "verifier", "generator")


# ------------------------------------------------------------------ memory
class AgentMemory:
    """AgentFlow's evolving memory: one record per planner step, in order.

    Each record (the authors' ``Memory.add_action``) holds ``tool_name``, ``sub_goal``, ``command``
    (what the executor ran) and ``result`` (the tool's output, cut to ``result_chars`` characters;
    the authors truncate serialised results too).
    """

    def __init__(self, result_chars: int = 1000) -> None:
        self.actions: Dict[str, Dict[str, Any]] = {}
        self.result_chars = int(result_chars)

    def add(self, step: int, tool_name: Optional[str], sub_goal: Optional[str], command: str, result: str) -> None:
        """Record planner step ``step`` (1-based) under the key ``"Action Step {step}"``."""
        res = str(result)
        if len(res) > self.result_chars:
            res = res[: self.result_chars] + "...(truncated)"
        self.actions[f"Action Step {int(step)}"] = {"tool_name": tool_name, "sub_goal": sub_goal,
                                                     "command": command, "result": res}

    def render(self) -> str:
        """The memory as the modules read it: JSON of the records, ``{}`` when empty."""
        return json.dumps(self.actions, ensure_ascii=False)

    def __len__(self) -> int:
        return len(self.actions)


# ------------------------------------------------------------------ prompts (ours, after the authors')
def tool_metadata(tools: Dict[str, Any]) -> str:
    """One line per tool: ``name: description; arguments: {json schema properties}``."""
    return "\n".join(f"- {n}: {t.description} Arguments: {json.dumps(t.parameters)}" for n, t in tools.items())


def analysis_prompt(query: str, tools: Dict[str, Any]) -> str:
    """Fixed engine: analyse the query (objectives, skills, which tools help)."""
    return (f"Task: analyse the query to find what it asks and which tools help.\n\nQuery: {query}\n"
            f"Available tools: {list(tools)}\nTool metadata:\n{tool_metadata(tools)}\n\n"
            "Give, briefly: the main objective, the skills needed, the useful tools and why.")


def planner_prompt(query: str, analysis: str, tools: Dict[str, Any], memory: AgentMemory, step: int,
                   max_steps: int) -> str:
    """The trained planner: choose the next step (one tool, a sub-goal, the context the tool needs)."""
    return (f"Task: choose the next step towards answering the query.\n\nQuery: {query}\n"
            f"Query analysis: {analysis}\nAvailable tools: {list(tools)}\nTool metadata:\n{tool_metadata(tools)}\n"
            f"Previous steps: {memory.render()}\nStep {step} of {max_steps}.\n\n"
            "Pick exactly one tool and a sub-goal it can achieve; give it every number or fact it needs.\n"
            "Answer in this format, ending with the three fields in this order:\n"
            "Justification: <why>\nContext: <what the tool needs>\nSub-Goal: <the objective>\nTool Name: <a tool name>")


def executor_prompt(query: str, sub_goal: str, tool_name: str, tool: Any, context: str) -> str:
    """Fixed engine: write the command (one ``<tool_call>``) that runs the planner's tool on its sub-goal."""
    return (f"Task: write the command that runs the chosen tool.\n\nQuery: {query}\nSub-goal: {sub_goal}\n"
            f"Tool: {tool_name}: {tool.description} Arguments: {json.dumps(tool.parameters)}\nContext: {context}\n\n"
            f'Reply with one call: <tool_call>{{"name": "{tool_name}", "arguments": {{...}}}}</tool_call>')


def verifier_prompt(query: str, analysis: str, tools: Dict[str, Any], memory: AgentMemory) -> str:
    """Fixed engine: is the memory enough to answer? Ends with ``Conclusion: STOP`` or ``Conclusion: CONTINUE``."""
    return (f"Task: decide whether the memory is complete and correct enough to answer the query.\n\n"
            f"Query: {query}\nAvailable tools: {list(tools)}\nInitial analysis: {analysis}\n"
            f"Memory (tools used and results): {memory.render()}\n\n"
            "Check what is missing, inconsistent or unverified. End with 'Conclusion: STOP' if the memory "
            "suffices, or 'Conclusion: CONTINUE' if more tool use is needed.")


def generator_prompt(query: str, analysis: str, memory: AgentMemory) -> str:
    """Fixed engine: the final answer from the query, the analysis and the memory (the authors' direct output)."""
    return (f"Task: give the final answer to the query from the steps taken.\n\nQuery: {query}\n"
            f"Initial analysis: {analysis}\nActions taken: {memory.render()}\n\n"
            "Summarise the steps briefly, then give a direct, precise answer to the query.")


# ------------------------------------------------------------------ parsing (the authors' rules)
_PLAN_RE = re.compile(r"Context:\s*(.*?)Sub-Goal:\s*(.*?)Tool Name:\s*(.*?)\s*(?=\n\n|\Z)", re.DOTALL)
_CONCLUSION_RE = re.compile(r"conclusion\**:?\s*\**\s*(\w+)", re.IGNORECASE | re.DOTALL)


def _canonical(name: str) -> str:
    return "_".join(p.lower() for p in re.split(r"[ _]+", name.strip()) if p)


def parse_plan(text: str, tool_names: List[str]) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """``(context, sub_goal, tool)`` from a planner turn; ``tool`` None when it names no available tool.

    The last ``Context: ... Sub-Goal: ... Tool Name: ...`` block counts (``**`` markup removed); the
    tool name matches case-insensitively with spaces and underscores as one separator (the authors'
    ``normalize_tool_name``). No block: ``(None, None, None)``.
    """
    found = _PLAN_RE.findall((text or "").replace("**", ""))
    if not found:
        return None, None, None
    context, sub_goal, name = (s.strip() for s in found[-1])
    name = name.splitlines()[0].strip() if name else ""
    want = _canonical(name)
    tool = next((t for t in tool_names if _canonical(t) == want), None) if want else None
    return context, sub_goal, tool


def parse_conclusion(text: str) -> str:
    """``"STOP"`` or ``"CONTINUE"`` from a verifier turn (the authors' ``extract_conclusion``).

    The last ``Conclusion: X`` with X in STOP/CONTINUE wins; otherwise the word ``stop`` anywhere means
    STOP, then ``continue`` CONTINUE; otherwise CONTINUE.
    """
    t = text or ""
    matches = [m.group(1).upper() for m in _CONCLUSION_RE.finditer(t)]
    if matches and matches[-1] in ("STOP", "CONTINUE"):
        return matches[-1]
    low = t.lower()
    if "stop" in low:
        return "STOP"
    return "CONTINUE"


def render_user(tokenizer: Any, text: str) -> List[int]:
    """Token ids of one chat user message ``text`` ending with the assistant header (plain-text content:
    special-token literals in ``text`` are split into ordinary tokens, as every rlpost prompt)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_framed(tokenizer, *template_parts(tokenizer, [{"role": "user", "content": text}], True))
    return encode_plain(tokenizer, text + "\n")


# ------------------------------------------------------------------ the sampler
@dataclasses.dataclass
class _Flow:
    pos: int
    query: str
    memory: AgentMemory
    analysis: str = ""
    steps: int = 0
    done: bool = False
    stopped: bool = False  # the verifier said STOP
    final_text: str = ""
    final_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_tool: int = 0
    rows: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    transcript: List[Dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class AgentFlowParams:
    """Parameters of :class:`AgentFlowSampler` (AgentFlow, arXiv:2510.05592)."""

    tools: List[str] = param(factory=lambda: ["calculator"], doc="registered tools (rlpost.envs.tools) the executor may run")
    tool_params: Optional[Dict[str, Any]] = param(None, "constructor arguments per tool, e.g. {python: {timeout: 5}}")
    max_steps: int = param(3, "planner turns per episode (authors' training config TOOL_STEPS: 3)")
    fixed_model: str = param("", "engine of the executor, verifier, analysis and generator: '' = frozen copy of the starting policy; 'policy' = the live policy (those calls never trained); else a model preset or directory loaded frozen")
    result_chars: int = param(1000, "characters of a tool result kept in the memory (our choice)")
    transcripts: bool = param(True, "write one episode's transcript per step to RUN_DIR/transcripts/")


@SAMPLERS.register(
    "agentflow",
    paper=PAPER,
    description="AgentFlow: planner (the policy) / executor / verifier / generator over an evolving memory; one row per planner turn.",
    params=AgentFlowParams,
    episodes=True,
    turn_rows=True,
)
class AgentFlowSampler(Sampler):
    """AgentFlow episodes, one row per planner turn (see the module docstring).

    Args:
        n_samples: episodes per prompt (``algo.n_samples_per_prompt``; Flow-GRPO's group size).
        tools, tool_params, max_steps, fixed_model, result_chars, transcripts: :class:`AgentFlowParams`.
    Raises:
        ValueError / ConfigError (through ``build_sampler``): ``max_steps < 1``, ``result_chars < 1``, no
        tool, an unknown tool; at the first :meth:`sample` a ConfigError when ``fixed_model=''`` and the
        rollout engine has no torch model to copy (vLLM).
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int = 1, *, tools: Any, tool_params: Optional[Dict[str, Any]], max_steps: int,
                 fixed_model: str, result_chars: int, transcripts: bool) -> None:
        super().__init__(n_samples)
        if int(max_steps) < 1:
            raise ValueError(f"max_steps={max_steps}: AgentFlow needs >= 1 planner turn. Fix: sampler.params.max_steps=3")
        if int(result_chars) < 1:
            raise ValueError(f"result_chars={result_chars} must be >= 1. Fix: sampler.params.result_chars=1000")
        names = [str(t) for t in (tools or [])]
        if not names:
            raise ValueError("sampler=agentflow needs at least one tool. Fix: sampler.params.tools=[calculator]")
        self.tool_names, self.tool_params = names, dict(tool_params or {})
        self.tools = build_tools(names, self.tool_params)  # unknown tool / bad parameter: fails at build time
        self.max_steps, self.result_chars = int(max_steps), int(result_chars)
        self.fixed_model, self.transcripts = str(fixed_model or ""), bool(transcripts)
        self.fixed: Any = None  # the fixed engine: at setup (fixed_model=''), else at the first sample (or set_fixed_engine)
        self.task: Any = None
        self.examples: Optional[List[Any]] = None
        self.run_dir: Any = None

    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """The task (query text, answer extraction), the training examples and the run directory."""
        from pathlib import Path

        self.task, self.examples = task, examples
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def setup(self, services: Any) -> None:
        """Take the fixed engine when the run is built (``Sampler`` hook), before a resume loads its checkpoint.

        With ``fixed_model=''`` the fixed modules are a frozen copy of the *starting* policy:
        copying here, from the run's own engine at construction, keeps that true for a
        resumed run too (a copy taken at the first sample after a resume would be the
        resumed weights). ``policy`` and a named model need nothing from the run.
        """
        if self.fixed is None and self.fixed_model == "":
            self.fixed_engine(services.local_engine)

    def set_fixed_engine(self, engine: Any) -> None:
        """Use ``engine`` for the executor, verifier, analysis and generator (tests; a remote fixed model)."""
        self.fixed = engine

    def fixed_engine(self, engine: Any) -> Any:
        """The engine of the fixed modules, built once from ``fixed_model`` (see the module docstring).

        Raises:
            ConfigError: ``fixed_model=''`` with an engine that has no torch model (vLLM): use a preset or ``policy``.
        """
        if self.fixed is not None:
            return self.fixed
        if self.fixed_model == "policy":
            return engine
        from rlpost.rollout.hf import HFRolloutEngine

        tok = engine.tokenizer
        if self.fixed_model:
            from rlpost.models.teacher import load_teacher

            device = getattr(engine, "device", "cpu")
            frozen = load_teacher(self.fixed_model, tok, torch.float32, device, seed=0, setting="sampler.params.fixed_model")
            self.fixed = HFRolloutEngine(frozen.module, tok, getattr(engine, "batch_size", 64), share_weights=True, device=device)
            return self.fixed
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError("sampler=agentflow with fixed_model='' copies the policy's starting weights from the rollout "
                              "engine, which has no torch model here. Fix: rollout=hf, or sampler.params.fixed_model="
                              "<model preset or directory> (a fixed engine, as the paper's), or fixed_model=policy.")
        self.fixed = HFRolloutEngine(model, tok, getattr(engine, "batch_size", 64), share_weights=False,
                                     device=getattr(engine, "device", "cpu"))  # a private frozen copy, never synced
        return self.fixed

    def _query(self, ctx: Any, pos: int, prompt_ids: List[int], tok: Any) -> str:
        if self.examples is not None and ctx.prompt_indices is not None:
            ex = self.examples[int(ctx.prompt_indices[pos])]
            return self.task.user_message(ex) if self.task is not None else str(ex.question)
        return tok.decode(list(prompt_ids), skip_special_tokens=True)

    def sample(self, engine, prompts, params, ctx):
        """Run every episode of the step to its end; one row per planner turn (module docstring)."""
        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            raise ValueError("sampler=agentflow needs a rollout engine with a tokenizer (rollout=hf or vllm)")
        fixed = self.fixed_engine(engine)
        counts = [int(c) for c in self.counts(len(prompts), ctx)]
        flows = [_Flow(pos, self._query(ctx, pos, p, tok), AgentMemory(self.result_chars))
                 for pos, (p, c) in enumerate(zip(prompts, counts)) for _ in range(c)]
        if not flows:
            raise ValueError("no rollouts requested")
        call = [0]

        def gen(eng, texts):
            sp = step_params(params, ctx, call[0])
            call[0] += 1
            return eng.generate([render_user(tok, t) for t in texts], sp)

        names = self.tool_names
        out = gen(fixed, [analysis_prompt(f.query, self.tools) for f in flows])
        for f, text in zip(flows, out.texts):
            f.analysis = text.strip()
            f.transcript.append({"module": "analysis", "content": f.analysis})
        for t in range(1, self.max_steps + 1):
            live = [f for f in flows if not f.done]
            if not live:
                break
            texts = [planner_prompt(f.query, f.analysis, self.tools, f.memory, t, self.max_steps) for f in live]
            ids = [render_user(tok, x) for x in texts]
            sp = step_params(params, ctx, call[0])
            call[0] += 1
            g = engine.generate(ids, sp)  # the trained planner
            plans = []
            for j, f in enumerate(live):
                keep = g.response_mask[j] > 0
                f.rows.append({"prompt": ids[j], "ids": g.response_ids[j][keep].tolist(),
                               "lps": g.rollout_logprobs[j][keep].tolist(), "temps": g.temperatures[j][keep].tolist(),
                               "finished": bool(g.finished[j]), "text": g.texts[j]})
                f.steps = t
                f.transcript.append({"module": "planner", "step": t, "content": g.texts[j]})
                plans.append(parse_plan(g.texts[j], names))
            run = [(f, p) for f, p in zip(live, plans) if p[2] is not None]
            commands: Dict[int, str] = {}
            if run:
                ex = gen(fixed, [executor_prompt(f.query, p[1], p[2], self.tools[p[2]], p[0]) for f, p in run])
                for (f, _), text in zip(run, ex.texts):
                    commands[id(f)] = text
            for f, (context, sub_goal, tool) in zip(live, plans):
                if tool is None:
                    f.invalid_tool += 1
                    command, result = "No command: the planner named no available tool.", "No result: no tool was run."
                else:
                    command = commands[id(f)]
                    calls = parse_tool_calls(command)
                    if calls:  # the planner's tool runs with the executor's arguments (the authors run the chosen tool)
                        c = calls[0]
                        r = call_tool(self.tools, ToolCall(tool, c.arguments, c.error))
                        f.tool_calls += 1
                        f.tool_errors += int(r.error)
                        result = r.content
                    else:
                        f.tool_errors += 1
                        result = "Error: the executor wrote no <tool_call> command."
                    f.transcript.append({"module": "executor", "step": t, "content": command, "result": result})
                f.memory.add(t, tool, sub_goal, command, result)
            if t == self.max_steps:
                for f in live:
                    f.done = True
                break
            ver = gen(fixed, [verifier_prompt(f.query, f.analysis, self.tools, f.memory) for f in live])
            for f, text in zip(live, ver.texts):
                verdict = parse_conclusion(text)
                f.transcript.append({"module": "verifier", "step": t, "content": text, "conclusion": verdict})
                if verdict == "STOP":
                    f.done, f.stopped = True, True
        fin = gen(fixed, [generator_prompt(f.query, f.analysis, f.memory) for f in flows])
        for j, f in enumerate(flows):
            f.final_text = fin.texts[j]
            f.final_tokens = int(fin.response_mask[j].sum())
            f.transcript.append({"module": "generator", "content": f.final_text})
        res = self._assemble(flows, engine, ctx)
        self._write_transcript(ctx, flows, res)
        return res

    def _assemble(self, flows: List[_Flow], engine: Any, ctx: Any):
        from rlpost.samplers.base import SampleResult

        if ctx.score is None:
            raise ValueError("sampler=agentflow scores its episodes' final answers and needs SamplerContext.score")
        scored = ctx.score([f.pos for f in flows], [f.final_text for f in flows],
                           torch.tensor([f.final_tokens for f in flows], dtype=torch.long))
        if getattr(scored, "token_rewards", None) is not None:
            raise ConfigError("sampler=agentflow scores the generator's final answer, which no planner token is part of, so "
                              "a process reward model's token rewards have nowhere to go. Fix: an outcome reward (no PRM).")
        ep_of, turn_of, last = [], [], []
        rows = []
        for e, f in enumerate(flows):
            for k, r in enumerate(f.rows):
                rows.append(r)
                ep_of.append(e)
                turn_of.append(k)
                last.append(k == len(f.rows) - 1)
        pad = pad_id_of(engine)
        B, R = len(rows), max(1, max(len(r["ids"]) for r in rows))
        p_ids, p_mask = left_pad([r["prompt"] for r in rows], pad)
        ids = torch.full((B, R), pad, dtype=torch.long)
        mask, lps, temps = torch.zeros(B, R), torch.zeros(B, R), torch.zeros(B, R)
        for i, r in enumerate(rows):
            n = len(r["ids"])
            ids[i, :n] = torch.tensor(r["ids"], dtype=torch.long)
            mask[i, :n] = 1.0
            lps[i, :n] = torch.tensor(r["lps"])
            temps[i, :n] = torch.tensor(r["temps"])
        gen = GenerationResult(p_ids, p_mask, ids, mask, lps, temps,
                               torch.tensor([r["finished"] for r in rows], dtype=torch.bool), [r["text"] for r in rows])
        ep = torch.tensor(ep_of, dtype=torch.long)
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        extras = {"flow_episode": ep, "flow_turn": torch.tensor(turn_of, dtype=torch.long),
                  "episode_final_row": torch.tensor(last, dtype=torch.bool),
                  "episode_turns": f32([flows[e].steps for e in ep_of]),
                  "episode_tool_calls": f32([flows[e].tool_calls for e in ep_of])}
        for k, v in scored.components.items():  # the episode's reward components, broadcast to its turns
            extras[f"reward_{k}"] = v.float()[ep]
        if scored.format_ok is not None:
            extras["format_ok"] = scored.format_ok.float()[ep]
        E = len(flows)
        calls = sum(f.tool_calls for f in flows)
        metrics = {"agentflow/planner_turns_mean": B / E,
                   "agentflow/verifier_stop_frac": sum(f.stopped for f in flows) / E,
                   "agentflow/invalid_tool_rate": sum(f.invalid_tool for f in flows) / B,
                   "agentflow/tool_error_rate": sum(f.tool_errors for f in flows) / max(1, calls),
                   "agentflow/memory_steps_mean": sum(len(f.memory) for f in flows) / E,
                   "episode/turns_mean": B / E,
                   "episode/tool_calls_mean": calls / E,
                   "episode/tool_call_frac": sum(f.tool_calls > 0 for f in flows) / E}
        return SampleResult(gen, torch.tensor([flows[e].pos for e in ep_of], dtype=torch.long), E, extras, metrics,
                            rewards=scored.total.float()[ep])

    def _write_transcript(self, ctx: Any, flows: List[_Flow], res: Any) -> None:
        """``RUN_DIR/transcripts/step_NNNNNN.json``: every module call of the step's first episode."""
        if not self.transcripts or self.run_dir is None:
            return
        try:
            f = flows[0]
            d = self.run_dir / "transcripts"
            d.mkdir(parents=True, exist_ok=True)
            rec = {"step": ctx.step, "prompt_index": (ctx.prompt_indices or [None])[0], "planner_turns": f.steps,
                   "reward": float(res.rewards[0]), "memory": f.memory.actions, "transcript": f.transcript}
            (d / f"step_{int(ctx.step):06d}.json").write_text(json.dumps(rec, indent=1))
        except OSError:  # pragma: no cover - a full disk must not stop training
            pass



def check_config(cfg: Any) -> None:
    """``sampler=agentflow`` with ``fixed_model=''`` copies the starting weights from the hf rollout engine:
    refuse other engines before anything loads (run from the config checks).

    Raises:
        ConfigError: ``rollout.engine`` is not ``hf`` while ``sampler.params.fixed_model`` is empty.
    """
    if str(cfg.sampler.name) != "agentflow":
        return
    fixed = str((cfg.sampler.params or {}).get("fixed_model", "") or "")
    engine = str(cfg.rollout.get("engine", "hf"))
    if not fixed and engine != "hf":
        raise ConfigError(f"sampler=agentflow with fixed_model='' copies the starting policy from the rollout engine's torch "
                          f"model, which rollout.engine={engine} does not have. Fix: sampler.params.fixed_model=<model preset "
                          f"or directory> (a fixed engine, as the paper's), fixed_model=policy, or rollout=hf.")
