"""LLM judges: a model grades each response against the question and the reference answer.

Two kinds share the prompt template and the score parsers:

* ``judge``: an OpenAI-compatible HTTP endpoint (``vllm serve``, SGLang, an API)
  through the ``openai`` client, with a concurrency limit, a per-call timeout
  and retries with exponential backoff under **one time budget per sample**
  (:func:`call_with_retries`), a cache of identical requests within a step, and
  a start-time check that the endpoint answers and serves the model.
* ``local_judge``: the same grading in-process with the Hugging Face engine
  of a local causal LM (batched greedy generation), for machines without a server.

Failure never stops a run: a call that fails after its retries or budget, or
a reply the parser cannot read, scores 0 and is counted
(``reward/<name>_errors``, ``reward/<name>_parse_errors``; both are added to
``reward/verifier_errors``), as a crashing rule verifier is.

Paper: "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena" (Zheng et al.,
arXiv:2306.05685), single-answer grading with a reference answer.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Registry, param
from rlpost.rewards.models import ModelReward, ModelScore, REWARD_MODELS
from rlpost.tasks.base import Example

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Answer to grade: {response}\n"
    "Is the answer to grade correct, given the reference? Reply with one integer from 0 (wrong) to 10 (correct).\n"
    "Score:"
)

#: judge reply parsers: ``fn(reply, score_max) -> score in [0, 1]``; raise :class:`JudgeParseError`
JUDGE_PARSERS = Registry("judge score parser", "parser")


class JudgeParseError(ValueError):
    """The judge's reply holds no score the parser can read."""


class JudgeCallError(RuntimeError):
    """A judge request failed on every try within its time budget."""


_NUM = re.compile(r"[-+]?\d+(?:\.\d+)?")


@JUDGE_PARSERS.register("number", description="the first number in the reply, divided by score_max, clipped to [0, 1]")
def parse_number(reply: str, score_max: float) -> float:
    """First number in ``reply`` over ``score_max``, clipped to [0, 1] (``"7/10"`` -> 0.7 with score_max 10).

    Raises:
        JudgeParseError: no number in the reply.
    """
    m = _NUM.search(reply or "")
    if m is None:
        raise JudgeParseError(f"no number in judge reply {reply[:80]!r}")
    return min(1.0, max(0.0, float(m.group(0)) / float(score_max)))


@JUDGE_PARSERS.register("yes_no", description="1 for a reply starting with yes/correct/true, 0 for no/incorrect/false")
def parse_yes_no(reply: str, score_max: float) -> float:
    """1.0 when the reply's first word is yes / correct / true, 0.0 for no / incorrect / wrong / false.

    Raises:
        JudgeParseError: the first word is neither.
    """
    m = re.search(r"[a-zA-Z]+", reply or "")
    w = m.group(0).lower() if m else ""
    if w in ("yes", "correct", "true", "right"):
        return 1.0
    if w in ("no", "incorrect", "wrong", "false"):
        return 0.0
    raise JudgeParseError(f"judge reply {reply[:80]!r} starts with neither yes nor no")


def render_judge_prompt(template: str, question: str, reference: Any, response: str) -> str:
    """``template`` with ``{question}``, ``{reference}``, ``{response}`` filled in (other braces kept).

    Raises:
        ConfigError: the template lacks ``{response}`` (the judge would not see the answer).
    """
    if "{response}" not in template:
        raise ConfigError("judge template must contain {response} (and usually {question} and {reference}).")
    return (template.replace("{question}", str(question)).replace("{reference}", str(reference))
            .replace("{response}", str(response)))


def call_with_retries(fn: Callable[[float], str], *, timeout_s: float, retries: int, backoff_s: float, budget_s: float,
                      clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> str:
    """Call ``fn(timeout)`` until it returns, retrying with exponential backoff inside one time budget.

    Try ``k`` (0-based) gets ``timeout = min(timeout_s, budget left)``; after a
    failure the wait is ``backoff_s * 2**k``, cut to the budget left. No try
    starts once the budget is spent, and at most ``1 + retries`` tries run.

    Args:
        fn: one request, given its timeout in seconds; raises on failure.
        clock, sleep: injectable for tests.
    Returns:
        ``fn``'s reply.
    Raises:
        JudgeCallError: every try failed or the budget ran out (the last error in the message).
    """
    t0 = clock()
    last: Optional[BaseException] = None
    for k in range(1 + max(0, int(retries))):
        left = budget_s - (clock() - t0)
        if left <= 0:
            break
        try:
            return fn(min(timeout_s, left))
        except Exception as e:  # noqa: BLE001 - any client error is retried, then scored 0
            last = e
        left = budget_s - (clock() - t0)
        if k < retries and left > 0:
            sleep(min(backoff_s * (2 ** k), left))
    raise JudgeCallError(f"judge call failed within {budget_s} s: {type(last).__name__ if last else 'budget'}: "
                         f"{str(last)[:200] if last else 'no time left'}")


@dataclass(frozen=True)
class JudgeParams:
    """An LLM judge behind an OpenAI-compatible endpoint."""

    base_url: str = param("http://127.0.0.1:8000/v1", "endpoint base URL (vllm serve: http://HOST:PORT/v1)")
    model: str = param("", "served model name (vllm serve: the path or --served-model-name); empty: the first served model")
    template: str = param(DEFAULT_TEMPLATE, "prompt with {question}, {reference} and {response}")
    parser: str = param("number", "score parser: number (first number / score_max) | yes_no")
    score_max: float = param(10.0, "the template's top score (number parser)")
    max_tokens: int = param(8, "tokens the judge may write")
    temperature: float = param(0.0, "judge sampling temperature (0: greedy, repeatable)")
    max_concurrency: int = param(8, "requests in flight at once")
    timeout_s: float = param(30.0, "per-request timeout in seconds")
    retries: int = param(2, "retries after a failed request (exponential backoff)")
    backoff_s: float = param(0.5, "first wait before a retry; doubles each retry")
    budget_s: float = param(60.0, "time budget per sample for all its tries and waits")
    api_key: str = param("EMPTY", "API key sent to the endpoint (local servers ignore it)")
    check_timeout_s: float = param(10.0, "timeout of the start-time reachability check")


class _JudgeBase(ModelReward):
    """Prompting, parsing, the per-step cache and the failure counts shared by both judges."""

    template = DEFAULT_TEMPLATE
    parser = "number"
    score_max = 10.0

    def _init_common(self, template: str, parser: str, score_max: float) -> None:
        self.template, self.parser, self.score_max = str(template), str(parser), float(score_max)
        JUDGE_PARSERS.entry(self.parser)  # unknown parser: ConfigError with the choices
        render_judge_prompt(self.template, "q", "r", "x")
        self._cache: Dict[str, float] = {}
        self.requests_sent = 0

    def begin_step(self) -> None:
        self._cache.clear()

    def prompts(self, responses: Sequence[str], examples: Sequence[Any]) -> List[str]:
        """One judge prompt per response (the example's question and gold answer filled in)."""
        return [render_judge_prompt(self.template, e.question, e.answer, r) for r, e in zip(responses, examples)]

    def replies(self, prompts: Sequence[str]) -> List[Any]:
        """The judge's reply text for each prompt, or the exception that ended its request."""
        raise NotImplementedError

    def score(self, responses: Sequence[str], examples: Sequence[Any], prior: Mapping[str, ModelScore]) -> ModelScore:
        prompts = self.prompts(responses, examples)
        todo = list(dict.fromkeys(p for p in prompts if p not in self._cache))  # identical requests: sent once
        hits = len(prompts) - len(todo)  # rows answered from the cache or by an identical row of this call
        failed: Dict[str, str] = {}
        parse_errors = call_errors = 0
        for p, rep in zip(todo, self.replies(todo) if todo else []):
            if isinstance(rep, BaseException):
                failed[p] = "call"
                continue
            try:
                self._cache[p] = JUDGE_PARSERS.get(self.parser)(rep, self.score_max)
            except JudgeParseError:
                failed[p] = "parse"
        vals = torch.zeros(len(prompts), dtype=torch.float32)
        for i, p in enumerate(prompts):
            if p in self._cache:
                vals[i] = self._cache[p]
            elif failed.get(p) == "parse":
                parse_errors += 1
            else:
                call_errors += 1
        return ModelScore(vals, parse_errors + call_errors,
                          {f"reward/{self.name}_parse_errors": float(parse_errors),
                           f"reward/{self.name}_call_errors": float(call_errors),
                           f"reward/{self.name}_requests": float(len(todo)),
                           f"reward/{self.name}_cache_hits": float(hits)}, raw=vals.clone())


@REWARD_MODELS.register("judge", params=JudgeParams, paper="Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena (arXiv:2306.05685)",
                        description="LLM judge over an OpenAI-compatible HTTP endpoint (openai client)")
class OpenAIJudge(_JudgeBase):
    """Grades responses by chat-completion requests to an OpenAI-compatible server.

    Requests run in a thread pool of ``max_concurrency``; each goes through
    :func:`call_with_retries` (``timeout_s`` per try, ``retries`` with
    ``backoff_s`` doubling, all within ``budget_s`` per sample). The client's
    own retries are off (``max_retries=0``) so the budget is the only clock.

    Raises:
        ConfigError: (``check``) the endpoint does not answer ``GET /models``
            within ``check_timeout_s``, or does not serve ``model``; an unknown
            parser or a template without ``{response}``.
    """

    def __init__(self, *, base_url: str, model: str, template: str, parser: str, score_max: float, max_tokens: int,
                 temperature: float, max_concurrency: int, timeout_s: float, retries: int, backoff_s: float,
                 budget_s: float, api_key: str, check_timeout_s: float) -> None:
        self._init_common(template, parser, score_max)
        self.base_url, self.model = str(base_url), str(model)
        self.max_tokens, self.temperature = int(max_tokens), float(temperature)
        self.max_concurrency = max(1, int(max_concurrency))
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.budget_s, self.api_key, self.check_timeout_s = float(budget_s), str(api_key), float(check_timeout_s)
        self._client: Any = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The ``openai.OpenAI`` client (built once; its own retries off)."""
        if self._client is None:
            try:
                import openai
            except ImportError:
                raise ConfigError("kind=judge needs the openai package: pip install openai") from None
            import logging

            logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would flood cli.log
            self._client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "EMPTY", max_retries=0,
                                         timeout=self.timeout_s)
        return self._client

    def check(self) -> None:
        try:
            served = [m.id for m in self.client().models.list(timeout=self.check_timeout_s).data]
        except Exception as e:  # noqa: BLE001 - any connection failure is the same user error
            raise ConfigError(
                f"task.reward.models.{self.name}: the judge endpoint {self.base_url} is unreachable "
                f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}). Fix: start the server "
                f"(e.g. `vllm serve MODEL_DIR --port 8000`), or set task.reward.models.{self.name}.base_url, or use "
                f"kind=local_judge for an in-process judge.") from None
        if not self.model:
            if not served:
                raise ConfigError(f"task.reward.models.{self.name}: {self.base_url} serves no model.")
            self.model = served[0]
        elif served and self.model not in served:
            raise ConfigError(f"task.reward.models.{self.name}: {self.base_url} does not serve model={self.model!r}; "
                              f"it serves {served}. Fix: task.reward.models.{self.name}.model=<one of them>.")

    def _request(self, prompt: str, timeout: float) -> str:
        with self._lock:
            self.requests_sent += 1
        r = self.client().chat.completions.create(
            model=self.model or "default", messages=[{"role": "user", "content": prompt}],
            max_tokens=self.max_tokens, temperature=self.temperature, timeout=timeout)
        return r.choices[0].message.content or ""

    def _one(self, prompt: str) -> Any:
        try:
            return call_with_retries(lambda t: self._request(prompt, t), timeout_s=self.timeout_s,
                                     retries=self.retries, backoff_s=self.backoff_s, budget_s=self.budget_s)
        except JudgeCallError as e:
            return e

    def replies(self, prompts: Sequence[str]) -> List[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rlpost-judge")
        return list(self._pool.map(self._one, prompts))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@dataclass(frozen=True)
class LocalJudgeParams:
    """An in-process judge: a local causal LM run by the Hugging Face engine."""

    model_path: str = param("", "local directory of the judge model (a causal LM)")
    template: str = param(DEFAULT_TEMPLATE, "prompt with {question}, {reference} and {response}")
    parser: str = param("number", "score parser: number (first number / score_max) | yes_no")
    score_max: float = param(10.0, "the template's top score (number parser)")
    max_new_tokens: int = param(6, "tokens the judge may write (greedy)")
    batch_size: int = param(16, "prompts per generate call")


@REWARD_MODELS.register("local_judge", params=LocalJudgeParams,
                        paper="Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena (arXiv:2306.05685)",
                        description="LLM judge in-process (HF generate of a local model), for machines without a server")
class LocalJudge(_JudgeBase):
    """Grades responses with a local causal LM: chat-templated judge prompts, batched greedy ``generate``.

    Loaded in the trainer's dtype on its device at :meth:`attach`. A generation
    that raises scores 0 for its rows and is counted, like a failed HTTP call.

    Raises:
        ConfigError: (``check``) no ``model_path`` or no such directory.
    """

    def __init__(self, *, model_path: str, template: str, parser: str, score_max: float, max_new_tokens: int,
                 batch_size: int) -> None:
        self._init_common(template, parser, score_max)
        self.model_path, self.max_new_tokens, self.batch_size = str(model_path), int(max_new_tokens), int(batch_size)
        self.model = self.tokenizer = None
        self.device: Any = "cpu"

    def check(self) -> None:
        import os

        if not self.model_path or not os.path.isdir(self.model_path):
            raise ConfigError(f"task.reward.models.{self.name}: kind=local_judge needs model_path=DIR, a local causal LM "
                              f"directory (got {self.model_path!r}).")

    def attach(self, tokenizer: Any = None, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"

    def replies(self, prompts: Sequence[str]) -> List[Any]:
        if self.model is None:
            self.attach()
        tok = self.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 if getattr(tok, "chat_template", None) else p for p in prompts]
        out: List[Any] = []
        for i in range(0, len(texts), max(1, self.batch_size)):
            chunk = texts[i:i + self.batch_size]
            try:
                enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
                self.requests_sent += len(chunk)
                with torch.no_grad():
                    gen = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                              pad_token_id=tok.pad_token_id)
                out.extend(tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
            except Exception as e:  # noqa: BLE001 - a failed generation scores its rows 0, counted
                out.extend([JudgeCallError(str(e))] * len(chunk))
        return out

    def close(self) -> None:
        self.model = None


def judge_scores(judge: _JudgeBase, items: Sequence[Tuple[str, Any, str]]) -> Tuple[List[float], int]:
    """Score ``(question, reference, response)`` triples with ``judge`` outside a run (benchmarks, tests).

    Returns:
        ``(scores, failures)``.
    """

    exs = [Example(i, q, a) for i, (q, a, _) in enumerate(items)]
    out = judge.score([r for _, _, r in items], exs, {})
    return out.values.tolist(), out.errors
