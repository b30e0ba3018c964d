"""Tasks on the real benchmark files of ../shared/data, verifiers and answer parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlpost.config.schema import TaskConfig
from rlpost.core.errors import ConfigError, DataError
from rlpost.tasks import build_task
from rlpost.tasks.answer_tags import extract_answer, extract_auto, parse_gsm8k_gold
from rlpost.tasks.file_task import parse_gold, read_rows
from rlpost.tasks.verifiers import VERIFIERS, verify

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared benchmark data not found at {DATA} (clone shared/ beside the repo)")


def math_cfg(**kw):
    base = dict(name="t", kind="math", dataset=None, train_size=0, eval_size=0, answer_format="auto", gold_format="auto")
    base.update(kw)
    return OmegaConf.structured(TaskConfig(**{k: v for k, v in base.items() if k != "reward"}))


# ---------------------------------------------------------------- real files
@needs_data
def test_every_shared_file_loads_with_gold_answers():
    files = sorted(DATA.rglob("*.jsonl"))
    assert {f.relative_to(DATA).as_posix() for f in files} >= {
        "gsm8k/train.jsonl", "gsm8k/test.jsonl", "aime24/test.jsonl", "amc23/test.jsonl"
    }
    expected_rows = {"gsm8k/train.jsonl": 7473, "gsm8k/test.jsonl": 1319, "aime24/test.jsonl": 30, "amc23/test.jsonl": 40}
    for f in files:
        rel = f.relative_to(DATA).as_posix()
        prompt = "question" if rel.startswith("gsm8k") else "problem"
        task = build_task(math_cfg(path=str(f), prompt_field=prompt))
        ex = task.eval_examples()
        assert len(ex) == expected_rows[rel]
        assert all(e.answer is not None and str(e.answer).strip() for e in ex)
        assert [e.index for e in ex] == list(range(len(ex)))


@needs_data
def test_gsm8k_gold_answers_on_real_rows():
    task = build_task(math_cfg(path=str(DATA / "gsm8k" / "test.jsonl"), gold_format="gsm8k"))
    ex = task.eval_examples()
    # row 1 of the test file: Janet's ducks, 16 - 3 - 4 = 9 eggs at $2 -> 18
    assert ex[0].answer == "18"
    assert ex[0].question.startswith("Janet")
    assert ex[1].answer == "3"
    # every gold answer is a plain number (commas removed)
    for e in ex:
        float(e.answer)
    assert not any("," in e.answer for e in ex)
    train = build_task(math_cfg(path=str(DATA / "gsm8k" / "train.jsonl"), gold_format="gsm8k")).eval_examples()
    assert train[0].answer == "72"  # Natalia: 48 + 24


@needs_data
def test_gsm8k_train_and_test_splits_from_two_files():
    task = build_task(
        math_cfg(path=str(DATA / "gsm8k" / "test.jsonl"), train_path=str(DATA / "gsm8k" / "train.jsonl"), train_size=100, eval_size=50)
    )
    assert len(task.train_examples()) == 100 and len(task.eval_examples()) == 50
    assert task.train_examples()[0].answer == "72" and task.eval_examples()[0].answer == "18"


@needs_data
def test_single_file_holds_out_first_rows_disjointly():
    task = build_task(math_cfg(path=str(DATA / "amc23" / "test.jsonl"), prompt_field="problem", eval_size=10))
    ev, tr = task.eval_examples(), task.train_examples()
    assert len(ev) == 10 and len(tr) == 30
    assert not {e.question for e in ev} & {e.question for e in tr}


@needs_data
def test_eval_only_file_task_explains_missing_training_split():
    task = build_task(math_cfg(path=str(DATA / "aime24" / "test.jsonl"), prompt_field="problem"))
    with pytest.raises(DataError, match="task.train_path"):
        task.train_examples()


@needs_data
def test_aime_and_amc_gold_answers_and_scoring():
    aime = build_task(math_cfg(path=str(DATA / "aime24" / "test.jsonl"), prompt_field="problem", gold_format="raw"))
    ex = aime.eval_examples()
    assert ex[0].answer == "204"
    assert ex[7].answer == "025"
    assert aime.score("The walk takes \\boxed{204} minutes.", ex[0]) == 1.0
    assert aime.score("so the answer is \\boxed{25}", ex[7]) == 1.0  # 025 == 25
    assert aime.score("\\boxed{205}", ex[0]) == 0.0
    amc = build_task(math_cfg(path=str(DATA / "amc23" / "test.jsonl"), prompt_field="problem", gold_format="raw"))
    a0 = amc.eval_examples()[0]
    assert a0.answer == 27.0
    assert amc.score("They meet after 1.5 hours, so \\boxed{27}.", a0) == 1.0
    assert amc.score("\\boxed{27.5}", a0) == 0.0
    neg = amc.eval_examples()[15]
    assert neg.answer == -1.0 and amc.score("\\boxed{-1}", neg) == 1.0


@needs_data
def test_gsm8k_scoring_of_free_form_responses():
    task = build_task(math_cfg(path=str(DATA / "gsm8k" / "test.jsonl"), gold_format="gsm8k"))
    ex = task.eval_examples()[0]
    assert task.score("She sells 9 eggs for $2 each, so she makes \\boxed{18} dollars.", ex) == 1.0
    assert task.score("9 * 2 = 18. The answer is $18.", ex) == 1.0
    assert task.score("#### 18", ex) == 1.0
    assert task.score("She makes 9 * 2 = 18 dollars", ex) == 1.0  # last number
    assert task.score("\\boxed{16}", ex) == 0.0
    assert task.score("", ex) == 0.0
    assert task.format_ok("\\boxed{18}") and not task.format_ok("18")


# ---------------------------------------------------------------- verifiers
@pytest.mark.parametrize(
    "pred,gold",
    [("\\frac{1}{2}", "0.5"), ("0.5", "\\frac{1}{2}"), ("\\boxed{27}", 27.0), ("27", "27.0"), ("1,000", "1000"),
     ("\\$18", "18"), ("5 \\text{ cm}", "5"), ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"), ("x=3", "3"), ("\\{2,1\\}", "\\{1,2\\}"),
     ("025", "25"), ("10\\%", "10")],
)
def test_math_verify_equivalences(pred, gold):
    assert verify("math_verify", pred, gold) == 1.0


@pytest.mark.parametrize(
    "pred,gold",
    [("\\frac{1}{2}", "0.6"), ("3", "4"), ("27.5", 27.0), ("\\sqrt{2}", "1.41"), ("-1", "1"), ("", "5"), ("hello", "5")],
)
def test_math_verify_non_equivalences(pred, gold):
    assert verify("math_verify", pred, gold) == 0.0


def test_missing_prediction_scores_zero_for_every_verifier():
    for name in VERIFIERS.names():
        params = {"dataset": "basic_arithmetic"} if name == "reasoning_gym" else {}
        assert verify(name, None, "5", params) == 0.0


def test_exact_numeric_regex_and_reasoning_gym_verifiers():
    assert verify("exact", " Paris. ", "paris") == 1.0
    assert verify("exact", "Lyon", "paris") == 0.0
    assert verify("numeric", "3.14159", "3.1416", {"rel_tol": 1e-4}) == 1.0
    assert verify("numeric", "3.14159", "3.1416") == 0.0
    assert verify("numeric", "1,000", "1000") == 1.0 and verify("numeric", "3/4", "0.75") == 1.0
    assert verify("numeric", "abc", "1") == 0.0
    assert verify("regex", "Yes", "yes|no") == 1.0 and verify("regex", "maybe", "yes|no") == 0.0
    with pytest.raises(ConfigError, match="regular expression"):
        verify("regex", "a", "(")
    assert verify("reasoning_gym", "-13", "-13", {"dataset": "basic_arithmetic"}) == 1.0
    assert verify("reasoning_gym", "12", "-13", {"dataset": "basic_arithmetic"}) == 0.0
    with pytest.raises(ConfigError, match="verifier_params.dataset"):
        verify("reasoning_gym", "1", "1")
    with pytest.raises(ConfigError, match="Valid choices"):
        verify("mathverify", "1", "1")


# ---------------------------------------------------------------- parsing
def test_answer_extraction_formats():
    assert parse_gsm8k_gold("He has 5 + 7 = <<5+7=12>>12\n#### 1,234") == "1234"
    assert parse_gsm8k_gold("no marker") is None
    assert extract_answer("a \\boxed{\\frac{1}{2}} b \\boxed{3}", "boxed") == "3"
    assert extract_answer("\\boxed{\\frac{a}{b}}", "boxed") == "\\frac{a}{b}"
    assert extract_answer("x <answer> 42 </answer>", "tags") == "42"
    assert extract_answer("costs $1,250.50 total", "last_number") == "1250.50"
    assert extract_auto("therefore the answer is 7.") == "7"
    assert extract_auto("<answer>B</answer> and \\boxed{C}") == "B"
    assert extract_auto("nothing here") is None
    assert parse_gold("#### 12", "auto") == "12"
    assert parse_gold("so \\boxed{\\pi}", "auto") == "\\pi"
    assert parse_gold(27.0, "auto") == 27.0


def test_answer_key_groups_equal_answers():
    from rlpost.tasks.file_task import MathTask

    t = MathTask.__new__(MathTask)
    t.cfg = OmegaConf.create({"answer_format": "auto"})
    assert t.answer_key("\\boxed{1,000}") == t.answer_key("the answer is 1000") == "1000"
    assert t.answer_key("\\boxed{27.0}") == "27"
    assert t.answer_key("no answer") is None


# ---------------------------------------------------------------- errors
def test_file_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="task.path"):
        read_rows(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": "2"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        read_rows(bad)
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        read_rows(csv)
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"q": "2+2?", "a": "4"}) + "\n")
    with pytest.raises(DataError, match="prompt_field"):
        build_task(math_cfg(path=str(ok)))
    with pytest.raises(DataError, match="gold_format"):
        build_task(math_cfg(path=str(ok), prompt_field="q", answer_field="a", gold_format="gsm8k"))
    with pytest.raises(ConfigError, match="task.path"):
        build_task(math_cfg())


def test_hub_dataset_offline_names_task_path(monkeypatch):
    import rlpost.tasks.file_task as ft

    monkeypatch.setattr(ft, "hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DataError, match=r"task\.path=/path/to/file\.jsonl"):
        build_task(math_cfg(dataset="openai/gsm8k", hub_config="main"))


def test_generic_jsonl_task_with_parquet_and_numeric_verifier(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"What is {i} / 4?", "target": str(i / 4)} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    cfg = OmegaConf.structured(
        TaskConfig(name="quarters", kind="jsonl", dataset=None, path=str(tmp_path / "d.parquet"), prompt_field="prompt",
                   answer_field="target", eval_size=4, train_size=0, answer_format="tags")
    )
    cfg.reward.verifier = "numeric"
    cfg.reward.verifier_params = {"rel_tol": 1e-3}
    task = build_task(cfg)
    assert len(task.eval_examples()) == 4 and len(task.train_examples()) == 8
    ex = task.eval_examples()[3]  # 3 / 4
    assert task.score("<answer>0.75</answer>", ex) == 1.0
    assert task.score("<answer>3/4</answer>", ex) == 1.0
    assert task.score("0.75", ex) == 0.0  # no tags
    assert "What is 3 / 4?" in task.user_message(ex)


def test_reasoning_gym_dataset_by_name_with_params():
    cfg = OmegaConf.structured(TaskConfig(name="countdown", kind="reasoning_gym", dataset="countdown",
                                          params={"min_numbers": 3, "max_numbers": 3}, train_size=20, eval_size=5))
    task = build_task(cfg)
    ex = task.eval_examples()[0]
    assert len(ex.meta["entry"]["metadata"]["numbers"]) == 3
    assert task.score(f"<answer>{ex.answer}</answer>", ex) == 1.0
    assert task.score("<answer>1+1</answer>", ex) < 1.0
    relabelled = task.with_answer(ex, "1+1")
    assert relabelled.meta["entry"]["answer"] == "1+1" and ex.meta["entry"]["answer"] == ex.answer
    with pytest.raises(ConfigError, match="reasoning-gym"):
        build_task(OmegaConf.structured(TaskConfig(kind="reasoning_gym", dataset="no_such_dataset")))


def test_format_regex_overrides_format_check():
    cfg = OmegaConf.structured(TaskConfig(name="a", kind="reasoning_gym", train_size=5, eval_size=2, answer_format="tags"))
    cfg.reward.format_regex = r"^<think>.*</think>"
    task = build_task(cfg)
    assert task.format_ok("<think>x</think><answer>1</answer>")
    assert not task.format_ok("<answer>1</answer>")


def test_prompt_rendering_with_chat_template_system_prompt_and_instruction_shortcut():
    class ChatTok:  # renders "<|s|>role: content\n" per message; ids are character codes, <|s|> is id 1
        chat_template = "fake"
        all_special_tokens = ["<|s|>"]

        def apply_chat_template(self, msgs, add_generation_prompt, tokenize=False, **kw):
            self.msgs = msgs
            assert add_generation_prompt and not tokenize
            return "".join(f"<|s|>{m['role']}: {m['content']}\n" for m in msgs) + "<|s|>assistant: "

        def convert_tokens_to_ids(self, t):
            return 1

        def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
            assert split_special_tokens  # message text is always plain text
            return {"input_ids": [ord(c) for c in text]}

    cfg = OmegaConf.structured(TaskConfig(train_size=3, eval_size=1, instruction="boxed", system_prompt="Be brief."))
    task = build_task(cfg)
    tok = ChatTok()
    ex = task.eval_examples()[0]
    ids = task.render_prompt(ex, tok)
    assert tok.msgs[0] == {"role": "system", "content": "Be brief."}
    assert tok.msgs[1]["content"].endswith("put your final answer within \\boxed{}.")
    assert tok.msgs[1]["content"].startswith(ex.question)
    text = tok.apply_chat_template(tok.msgs, True)
    # the template's three <|s|> are the only special ids; every other character is encoded as itself
    # (system, user, assistant header)
    plain = [x for part in text.split("<|s|>") for x in ([1] + [ord(c) for c in part])][1:]
    assert ids == plain and ids.count(1) == 3
    cfg.instruction = "Answer in French."
    assert build_task(cfg).user_message(task.eval_examples()[0]).endswith("\nAnswer in French.")


def test_math_style_boxed_solutions(tmp_path):
    rows = [
        {"problem": "Compute 1/2 of 1.", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
        {"problem": "Solve x+1=3.", "solution": "So $x = \\boxed{2}$. (Not \\boxed{3}.) Final: $\\boxed{2}$", "level": "Level 2"},
        {"problem": "Interval?", "solution": "The answer is $\\boxed{[0, \\infty)}$."},
    ]
    f = tmp_path / "math.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = build_task(math_cfg(path=str(f), prompt_field="problem", answer_field="solution"))
    ex = task.eval_examples()
    assert [e.answer for e in ex] == ["\\frac{1}{2}", "2", "[0, \\infty)"]
    assert ex[0].meta["level"] == "Level 1"
    assert task.score("Thus the result is \\boxed{0.5}.", ex[0]) == 1.0
    assert task.score("\\boxed{\\dfrac{1}{2}}", ex[0]) == 1.0
    assert task.score("\\boxed{\\frac{1}{3}}", ex[0]) == 0.0
    assert task.score("\\boxed{x=2}", ex[1]) == 1.0
    assert task.score("\\boxed{[0,\\infty)}", ex[2]) == 1.0
    assert task.score("\\boxed{(0,\\infty)}", ex[2]) == 0.0


@needs_data
def test_gsm8k_reference_solution_is_the_worked_answer_field():
    task = build_task(math_cfg(path=str(DATA / "gsm8k" / "test.jsonl"), gold_format="gsm8k"))
    ex = task.eval_examples()[0]
    sol = task.reference_solution(ex)
    assert sol.rstrip().endswith("#### 18") and len(sol) > 40 and task.score(sol, ex) == 1.0
