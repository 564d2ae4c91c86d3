"""Data files as the ecosystem writes them (issue 48): text, completion and chat read JSONL, JSON, parquet, CSV, arrow
and save_to_disk directories by what the file is, ShareGPT as chat, Alpaca as completion, columns named by
data.columns; a file that does not fit its format is refused in one line."""

import json

import pytest
from helpers import LAMP2, REPO, assert_one_line_error, cli, snapshot

from lcsb_cli.data.lm import load_lm_split
from lcsb_cli.errors import BadInput
from lcsb_cli.model.load import load_tokenizer, materialize_preset
from lcsb_cli.recipe import load_recipe

NO_LAMP2 = ["data.eval=null", "data.train_labels=null", "data.eval_labels=null"]
DOCS = ["Alma leads this faithful adaptation of the celebrated novel.", "Readers of the book will know every chapter."]
QA = [
    {"id": "q1", "prompt": "Who leads?\nAnswer:", "completion": " Alma"},
    {"id": "q2", "prompt": "Pace?", "completion": " steady"},
]
TURNS = [
    ("system", "Be brief."),
    ("user", "My dog?"),
    ("assistant", "Biscuit."),
    ("user", "Cafe?"),
    ("assistant", "Fern."),
]
CHAT = [{"id": "c1", "messages": [{"role": role, "content": text} for role, text in TURNS]}]
RECORDS = {"text": [{"text": doc} for doc in DOCS], "completion": QA, "chat": CHAT}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(materialize_preset("tiny-qwen2"))


def read(path, fmt, tokenizer, **options) -> list[dict]:
    return load_lm_split(str(path), fmt, tokenizer, 64, "error", **options).rows


def write_jsonl(path, records) -> object:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def dataset(records):
    """A datasets.Dataset of the records; datasets imported after lcsb_cli, as in the CLI (lcsb_cli's import keeps
    the libraries' progress bars off stderr, which the one-line error checks read)."""
    import datasets

    return datasets.Dataset.from_list(records)


def written(method: str, name: str):
    """A writer of records through datasets' own `method` (to_parquet, to_csv, save_to_disk) into tmp/name."""

    def write(tmp, records):
        getattr(dataset(records), method)(str(tmp / name))
        return tmp / name

    return write


def saved_arrow(tmp, records):
    return written("save_to_disk", "saved")(tmp, records) / "data-00000-of-00001.arrow"


def arrow_ipc_file(tmp, records):
    import pyarrow

    table = dataset(records).data.table
    with pyarrow.ipc.new_file(str(tmp / "data.arrow"), table.schema) as writer:
        writer.write_table(table)
    return tmp / "data.arrow"


def json_list(tmp, records):
    (tmp / "d.json").write_text(json.dumps(records, indent=2))
    return tmp / "d.json"


WRITERS = {
    "save_to_disk dir": written("save_to_disk", "saved"),
    "save_to_disk .arrow": saved_arrow,
    "arrow IPC file": arrow_ipc_file,
    "parquet": written("to_parquet", "d.parquet"),
    "parquet named .txt": written("to_parquet", "d.txt"),
    "JSON list": json_list,
    "CSV": written("to_csv", "d.csv"),
    "CSV without suffix": written("to_csv", "export"),
}
# CSV holds no list of turns
CASES = [(fmt, kind) for fmt in RECORDS for kind in WRITERS if not (fmt == "chat" and kind.startswith("CSV"))]


@pytest.mark.parametrize("fmt, kind", CASES, ids=[f"{fmt}-{kind}" for fmt, kind in CASES])
def test_every_file_kind_gives_the_rows_of_the_same_records_as_jsonl(tmp_path, tokenizer, fmt, kind):
    """The table's first three rows: a save_to_disk directory, its .arrow file, parquet and a CSV with a text column
    are read as records (before: "does not exist", a binary file read as text, the CSV header trained on)."""
    expected = read(write_jsonl(tmp_path / "records.jsonl", RECORDS[fmt]), fmt, tokenizer)
    path = WRITERS[kind](tmp_path, RECORDS[fmt])
    before = snapshot(tmp_path)
    assert read(path, fmt, tokenizer) == expected
    assert snapshot(tmp_path) == before, "reading wrote into the user's data"


def test_plain_text_stays_plain_text(tmp_path, tokenizer):
    (tmp_path / "docs.txt").write_text("\n\n".join(DOCS) + "\n")
    from_txt = read(tmp_path / "docs.txt", "text", tokenizer)
    assert from_txt == read(write_jsonl(tmp_path / "docs.jsonl", RECORDS["text"]), "text", tokenizer)
    # a .txt file is plain text even when its first line reads as a CSV header
    (tmp_path / "header.txt").write_text("text\n\n" + "\n\n".join(DOCS) + "\n")
    header_too = write_jsonl(tmp_path / "header.jsonl", [{"text": "text"}, *RECORDS["text"]])
    assert read(tmp_path / "header.txt", "text", tokenizer) == read(header_too, "text", tokenizer)


def test_sharegpt_reads_as_the_same_chat(tmp_path, tokenizer):
    sharegpt_names = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": sharegpt_names[role], "value": text} for role, text in TURNS]
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{"id": "c1", "conversations": turns}])
    assert read(sharegpt, "chat", tokenizer) == read(write_jsonl(tmp_path / "c.jsonl", CHAT), "chat", tokenizer)
    # "user" and "assistant" are ShareGPT names too, and the turns may sit under "messages"
    renamed = [{"from": role, "value": text} for role, text in TURNS]
    also = write_jsonl(tmp_path / "also.jsonl", [{"id": "c1", "messages": renamed}])
    assert read(also, "chat", tokenizer) == read(sharegpt, "chat", tokenizer)
    tool = write_jsonl(tmp_path / "tool.jsonl", [{"conversations": [*turns, {"from": "observation", "value": "x"}]}])
    with pytest.raises(BadInput, match=r"tool\.jsonl: line 1: message 5: \"from\" is 'observation'"):
        read(tool, "chat", tokenizer)


def test_alpaca_reads_as_completion_with_the_input_after_a_blank_line(tmp_path, tokenizer):
    alpaca = [
        {"instruction": "Name the dog.", "input": "It is brown.", "output": "Biscuit"},
        {"instruction": "Name the cafe.", "input": "", "output": "Little Fern"},
    ]
    same = [
        {"prompt": "Name the dog.\n\nIt is brown.\n\n", "completion": "Biscuit"},
        {"prompt": "Name the cafe.\n\n", "completion": "Little Fern"},
    ]
    as_read = read(write_jsonl(tmp_path / "alpaca.jsonl", alpaca), "completion", tokenizer)
    assert as_read == read(write_jsonl(tmp_path / "same.jsonl", same), "completion", tokenizer)
    assert [row["reference"] for row in as_read] == ["Biscuit", "Little Fern"]


def test_data_columns_name_the_columns_of_each_role(tmp_path, tokenizer):
    renamed = [{"qid": r["id"], "question": r["prompt"], "answer": r["completion"]} for r in QA]
    path = written("to_csv", "qa.csv")(tmp_path, renamed)
    with pytest.raises(
        BadInput, match="qa.csv is a CSV file with columns qid, question, answer, which format completion"
    ):
        read(path, "completion", tokenizer)
    columns = {"id": "qid", "prompt": "question", "completion": "answer"}
    assert read(path, "completion", tokenizer, columns=columns) == read(
        write_jsonl(tmp_path / "qa.jsonl", QA), "completion", tokenizer
    )
    recipe = load_recipe(
        LAMP2,
        [
            "data.format=completion",
            f"data.train={path}",
            *NO_LAMP2,
            "data.columns={prompt: question, completion: answer}",
        ],
    )
    assert recipe.data.columns == {"prompt": "question", "completion": "answer"}


@pytest.mark.parametrize(
    "columns, message",
    [
        ("{question: prompt}", "'question' is not a role of format completion; its roles are id, prompt, completion"),
        ("{prompt: q, completion: q}", "two roles name the same column"),
        ("question", "data.columns must be a mapping"),
    ],
)
def test_bad_data_columns_are_refused_by_validate(columns, message):
    proc = cli("validate", str(LAMP2), "data.format=completion", *NO_LAMP2, f"data.columns={columns}")
    assert message in assert_one_line_error(proc, "data.columns")


def refused(tmp_path):
    import datasets

    (tmp_path / "binary.bin").write_bytes(b"\x00\x01\x02\x03 not text")
    (tmp_path / "plain.md").write_text("Notes, not records.\n")
    (tmp_path / "emptydir").mkdir()
    datasets.DatasetDict({"train": dataset(QA), "test": dataset(QA)}).save_to_disk(str(tmp_path / "splits"))
    written("to_csv", "no_text.csv")(tmp_path, [{"body": doc} for doc in DOCS])
    return [
        ("text", "binary.bin", ["binary file", 'records with "text"', "parquet"]),
        ("completion", "plain.md", ["is plain text", 'records with "prompt" and "completion"', "Alpaca"]),
        ("text", "emptydir", ["without dataset_info.json or state.json"]),
        ("completion", "splits", ["several splits (test, train)", "data.train=", "splits/train"]),
        ("text", "no_text.csv", ["a CSV file with columns body", 'records with "text"', "data.columns"]),
        ("chat", "missing.jsonl", ["does not exist"]),
    ]


def test_a_file_that_does_not_fit_its_format_is_refused_in_one_line(tmp_path, tokenizer):
    for fmt, name, needles in refused(tmp_path):
        with pytest.raises(BadInput) as caught:
            read(tmp_path / name, fmt, tokenizer)
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"data.train: {tmp_path / name}"), message
        assert all(needle in message for needle in needles), (name, message)


def test_lamp2_questions_left_as_text_eval_exit_2_in_one_line(tmp_path):
    """The table's silent case: LaMP-2's dev_questions.json left as data.eval under format text trained as "text"."""
    (tmp_path / "docs.txt").write_text("\n\n".join(DOCS) + "\n")
    run = tmp_path / "run"
    proc = cli(
        "train",
        str(LAMP2),
        "--output",
        str(run),
        "data.format=text",
        f"data.train={tmp_path / 'docs.txt'}",
        "data.train_labels=null",
        "data.eval_labels=null",
        "train.max_steps=1",
    )
    line = assert_one_line_error(proc, "data.eval", "dev_questions.json", "a JSON document with columns id, input")
    assert "format text does not read" in line and not run.exists()


def test_train_on_a_save_to_disk_directory_end_to_end(tmp_path):
    questions = json.loads((REPO / "recipes" / "data" / "lamp2" / "train_questions.json").read_text())
    docs = [{"text": q["input"].split("description:", 1)[1].strip()} for q in questions[:40]]
    saved = written("save_to_disk", "saved")(tmp_path, docs)
    run = tmp_path / "run"
    proc = cli(
        "train",
        str(LAMP2),
        "--output",
        str(run),
        "model.name=lamp-tiny",
        "data.format=text",
        f"data.train={saved}",
        *NO_LAMP2,
        "data.max_length=64",
        "train.max_steps=1",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
