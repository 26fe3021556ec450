"""Tool-calling rows (sharegpt function_call / observation turns and a tools column) are read as
LLaMA-Factory's sharegpt converter reads them, tokenized token for token as its SFT preprocessing
tokenizes them (of the raw file and of the prepared one), refused with a named error when LLaMA-Factory
could not use them, and scored on the call at evaluation."""

import json

import pytest
from datasets import load_from_disk
from llmft.core import conversation
from llmft.core import sources as ds
from llmft.core.assets import synthetic_rows
from llmft.core.io import read_jsonl
from llmft.core.lf.pretokenize import SFTEncoder
from llmft.core.sources import DataError, RowError, validate
from llmft.data.prepare import content_key, prepare
from llmft.evaluate import run as ev

from tests.lfref import llamafactory_preprocess, rows_of

# Templates of LLaMA-Factory 0.9.5 with their own tool formats (qwen, llama3, glm4, mistral), and
# `default`, whose tool format is the generic "Action:" one.
TEMPLATES = ["qwen", "llama3", "glm4", "mistral", "default"]

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "the city"}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}},
    },
}
TOOLS = json.dumps([WEATHER, TIME])


def call(name, **arguments):
    return json.dumps({"name": name, "arguments": arguments})


def conv(*turns, key="conversations", **extra):
    role_key, content_key_ = ("from", "value") if key == "conversations" else ("role", "content")
    return {key: [{role_key: r, content_key_: v} for r, v in turns], **extra}


def tool_rows(n: int = 30) -> list[dict]:
    """Raw sharegpt rows: calls answered by observations, calls as the last answer, both spellings,
    system prompts, tools as a string and as a list, "[]" tools, and plain conversations."""
    cities = "Paris Rome Oslo Lima Kyiv Riga Bern Doha Suva Apia".split()
    rows = []
    for i in range(n):
        city = cities[i % len(cities)] + str(i)
        kind = i % 5
        if kind == 0:
            rows.append(
                conv(
                    ("human", f"Weather in {city}?"),
                    ("function_call", call("get_weather", city=city)),
                    ("observation", json.dumps({"temp": i})),
                    ("gpt", f"It is {i} degrees in {city}."),
                    tools=TOOLS,
                    system="Be brief.",
                )
            )
        elif kind == 1:
            rows.append(
                conv(
                    ("system", "You help with weather."),
                    ("human", f"And in {city}?"),
                    ("function_call", call("get_weather", city=city)),
                    tools=TOOLS,
                )
            )
        elif kind == 2:
            rows.append(
                conv(
                    ("user", f"Time in {city}?"),
                    ("function_call", call("get_time", zone="cet")),
                    ("observation", "12:00"),
                    ("assistant", "It is noon."),
                    ("user", f"And the weather in {city}?"),
                    ("function_call", call("get_weather", city=city)),
                    key="messages",
                    tools=TOOLS,
                )
            )
        elif kind == 3:
            rows.append(conv(("human", f"Say hi to {city}"), ("gpt", f"hi {city}"), tools="[]"))
        else:
            rows.append(conv(("human", f"Name {city}"), ("gpt", city), tools=""))
    return rows


def llamafactory_rows(raw_rows, template, tokenizer, data_args=None):
    """LLaMA-Factory's sharegpt converter and SFT processor on the raw rows."""
    from llamafactory.data.converter import SharegptDatasetConverter
    from llamafactory.data.parser import DatasetAttr
    from llamafactory.data.processor import SupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments

    batch = {k: [] for k in ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")}
    for raw in raw_rows:
        key = "conversations" if "conversations" in raw else "messages"
        attr = DatasetAttr("file", dataset_name="raw", formatting="sharegpt", messages=key)
        attr.system, attr.tools = "system", "tools"
        if key == "messages":
            attr.role_tag, attr.content_tag, attr.user_tag, attr.assistant_tag = (
                "role",
                "content",
                "user",
                "assistant",
            )
        out = SharegptDatasetConverter(attr, DataArguments())({"system": None, "tools": None, **raw})
        for k in batch:
            batch[k].append(out[k])
    proc = SupervisedDatasetProcessor(
        template=template,
        tokenizer=tokenizer,
        processor=None,
        data_args=data_args or DataArguments(cutoff_len=100_000),
    )
    return proc.preprocess_dataset(batch), batch


def test_canonical_tool_rows():
    rows = [validate("f", i, raw, "sharegpt") for i, raw in enumerate(tool_rows(5), 1)]
    assert rows[0] == {
        "messages": [
            {"role": "user", "content": "Weather in Paris0?"},
            {"role": "function", "content": call("get_weather", city="Paris0")},
            {"role": "observation", "content": '{"temp": 0}'},
            {"role": "assistant", "content": "It is 0 degrees in Paris0."},
        ],
        "system": "Be brief.",
        "tools": TOOLS,
    }
    assert rows[1]["system"] == "You help with weather." and rows[1]["messages"][-1]["role"] == "function"
    assert rows[3] == {
        "messages": [
            {"role": "user", "content": "Say hi to Lima3"},
            {"role": "assistant", "content": "hi Lima3"},
        ],
        "tools": "[]",
    }
    assert rows[4] == {"instruction": "Name Kyiv4", "input": "", "output": "Kyiv4"}  # plain: as before
    # A list is serialised as LLaMA-Factory's openai converter serialises it.
    listed = validate("f", 1, {**tool_rows(1)[0], "tools": [WEATHER, TIME]}, "sharegpt")
    assert listed["tools"] == json.dumps([WEATHER, TIME], ensure_ascii=False)


@pytest.mark.parametrize("template", TEMPLATES)
def test_conversation_is_llamafactory_sharegpt_conversion(tokenizer_dir, template):
    enc = SFTEncoder(tokenizer_dir, template)
    raw_rows = tool_rows(10)
    _, batch = llamafactory_rows(raw_rows, enc.template, enc.tokenizer)
    for i, raw in enumerate(raw_rows):
        row = validate("f", i + 1, raw, "sharegpt")
        prompt, response = conversation.split(row)
        assert (prompt, response) == (batch["_prompt"][i], batch["_response"][i])
        assert conversation.system(row) == (batch["_system"][i] or "")
        assert conversation.tools(row) == (batch["_tools"][i] or "")


@pytest.mark.parametrize("template", TEMPLATES)
def test_encoder_equals_llamafactory_on_the_raw_rows(tokenizer_dir, template):
    enc = SFTEncoder(tokenizer_dir, template)
    raw_rows = tool_rows(30) + synthetic_rows(20, seed=3)  # tool and plain rows in one chunk
    plain = [
        {
            "conversations": [
                {
                    "from": "human",
                    "value": r["instruction"] + "\n" + r["input"] if r["input"] else r["instruction"],
                },
                {"from": "gpt", "value": r["output"]},
            ]
        }
        for r in raw_rows[30:]
    ]
    raw_rows = raw_rows[:30] + plain
    canonical = [validate("f", i, raw, "sharegpt") for i, raw in enumerate(raw_rows, 1)]
    assert not any(isinstance(r, RowError) for r in canonical)
    theirs, _ = llamafactory_rows(raw_rows, enc.template, enc.tokenizer)
    enc.encode(canonical)
    ours = enc.encode(canonical)  # a second chunk: the fast paths where they apply
    assert len(theirs["input_ids"]) == len(raw_rows)
    for i in range(len(raw_rows)):
        assert rows_of(ours, i) == (theirs["input_ids"][i], theirs["labels"][i]), raw_rows[i]


@pytest.mark.parametrize("template", ["llama3", "glm4", "default"])
def test_empty_tools_list_writes_the_empty_system_block_llamafactory_writes(tokenizer_dir, template):
    enc = SFTEncoder(tokenizer_dir, template)
    turns = (("human", "hi"), ("gpt", "hello"))
    raw_rows = [conv(*turns, tools="[]"), conv(*turns, tools=""), conv(*turns), conv(*turns, tools="{}")]
    theirs, _ = llamafactory_rows(raw_rows, enc.template, enc.tokenizer)
    ours = enc.encode([validate("f", i, raw, "sharegpt") for i, raw in enumerate(raw_rows, 1)])
    for i in range(len(raw_rows)):
        assert rows_of(ours, i) == (theirs["input_ids"][i], theirs["labels"][i])
    with_empty, without = rows_of(ours, 0)[0], rows_of(ours, 1)[0]
    assert rows_of(ours, 2)[0] == without and rows_of(ours, 3)[0] == with_empty
    if template != "default":  # its system formatter writes nothing for an empty system prompt
        assert len(with_empty) > len(without)


def write_json(path, rows):
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="module", params=["qwen", "llama3"])
def prepared(request, tmp_path_factory, tokenizer_dir):
    template = request.param
    tmp = tmp_path_factory.mktemp(f"prep_{template}")
    raw = write_json(tmp / "tools.json", tool_rows(60))
    alpaca = tmp / "a.jsonl"
    with_tools = [
        {"instruction": f"Weather {i}?", "output": f"Use get_weather {i}.", "tools": TOOLS} for i in range(5)
    ]
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(40, seed=5) + with_tools))
    sources = [{"path": str(raw), "format": "sharegpt"}, {"path": str(alpaca)}]
    # No decontamination: the synthetic tool rows differ only in a city, and every row should stay.
    stats = prepare(
        sources, tmp / "out", tokenizer_dir, template, 4096, 0.3, "s", "fail", dedup={"decontaminate": False}
    )
    return tmp, template, stats


def test_prepared_dataset_equals_llamafactory_preprocessing(tmp_path, prepared, tokenizer_dir):
    tmp, template, stats = prepared
    info = json.loads((tmp / "out" / "dataset_info.json").read_text())
    assert info["llmft_train"]["formatting"] == "sharegpt" and "tools" in info["llmft_train"]["columns"]
    train = read_jsonl(tmp / "out" / "train.jsonl")
    assert any("output" in r for r in train) and all("messages" in r for r in train)
    theirs = llamafactory_preprocess(tmp_path, tmp / "out", tokenizer_dir, 4096, template=template)
    ours = load_from_disk(str(tmp / "out" / "tokenized"))
    for split, lf in (("train", theirs["train_dataset"]), ("validation", theirs["eval_dataset"])):
        assert len(ours[split]) == len(lf) > 5
        assert ours[split][:] == lf[:]


def test_prepared_rows_equal_llamafactory_on_the_raw_file(tmp_path, prepared, tokenizer_dir):
    """LLaMA-Factory reading the user's own file (sharegpt, tools column) makes the same rows."""
    tmp, template, stats = prepared
    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    (raw_dir / "tools.json").write_text(json.dumps([r for r in tool_rows(60) if "conversations" in r]))
    entry = {
        "file_name": "tools.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "system": "system", "tools": "tools"},
    }
    (raw_dir / "dataset_info.json").write_text(json.dumps({"llmft_train": entry, "llmft_heldout": entry}))
    theirs = llamafactory_preprocess(tmp_path, raw_dir, tokenizer_dir, 4096, template=template)
    ours = load_from_disk(str(tmp / "out" / "tokenized"))
    mine = {tuple(r["input_ids"]): r["labels"] for s in ("train", "validation") for r in ours[s]}
    lf = theirs["train_dataset"]
    assert len(lf) == 48
    for row in lf:
        assert mine[tuple(row["input_ids"])] == row["labels"]


def test_packing_tool_rows_equals_llamafactory_packing(tmp_path, monkeypatch, prepared, tokenizer_dir):
    from datasets.arrow_writer import OptimizedTypedSequence
    from llmft.sft.packing import pack

    monkeypatch.setattr(OptimizedTypedSequence, "__init__", OptimizedTypedSequence.__init__)
    tmp, template, _ = prepared
    out = tmp / "out"
    longest = max(len(r["input_ids"]) for r in load_from_disk(str(out / "tokenized"))["train"])
    # cutoff_len at the longest row: LLaMA-Factory truncates those rows when it packs, through the
    # text (tools included), the way packing.py hands them to it.
    args = {"template": template, "cutoff_len": longest, "preprocessing_num_workers": 1, "packing": True}
    pack(out / "tokenized", out, tmp_path / "packed", tokenizer_dir, args)
    theirs = llamafactory_preprocess(tmp_path, out, tokenizer_dir, **args)
    ours = load_from_disk(str(tmp_path / "packed"))
    for split, lf in (("train", theirs["train_dataset"]), ("validation", theirs["eval_dataset"])):
        assert ours[split][:] == lf[:]


BAD = [
    (conv(("function_call", call("get_weather", city="x")), ("gpt", "a")), ds.ROLE_ORDER, "conversations[1]"),
    (conv(("human", "q"), ("gpt", "a"), ("observation", "{}")), ds.ROLE_ORDER, "conversations"),
    (conv(("human", "q"), ("observation", "{}")), ds.ROLE_ORDER, "conversations[2]"),
    (conv(("human", "q"), ("gpt", "a"), tools="[{not json"), ds.BAD_TOOLS, "tools"),
    (conv(("human", "q"), ("gpt", "a"), tools='{"name": "f"}'), ds.BAD_TOOLS, "tools"),
    (conv(("human", "q"), ("gpt", "a"), tools='[{"description": "no name"}]'), ds.BAD_TOOLS, "tools"),
    (conv(("human", "q"), ("gpt", "a"), tools=5), ds.WRONG_TYPE, "tools"),
    (
        conv(("human", "q"), ("function_call", '{"arguments": {}}')),
        ds.BAD_FUNCTION_CALL,
        "conversations[2].value",
    ),
    (conv(("human", "q"), ("function_call", "[]")), ds.BAD_FUNCTION_CALL, "conversations[2].value"),
    (conv(("user", "q"), ("tool", "x"), key="messages"), ds.UNKNOWN_ROLE, "messages[2].role"),
    (conv(("human", "q"), ("function_call", "")), ds.EMPTY, "conversations[2].value"),
]


@pytest.mark.parametrize("raw,reason,field", BAD)
def test_bad_tool_rows_are_named(raw, reason, field):
    err = validate("f.json", 7, raw, "sharegpt")
    assert isinstance(err, RowError), err
    assert (err.row, err.reason, err.field) == (7, reason, field)
    assert err.message().startswith(f"f.json row 7: field '{field}'")


def test_template_refusals_are_named_rows(tokenizer_dir):
    """What only the template's formatters refuse: GLM-4 takes one call at a time; the default
    tool format needs parameters; a call that is not JSON nor inside the tool-call words."""
    glm = SFTEncoder(tokenizer_dir, "glm4").template
    default = SFTEncoder(tokenizer_dir, "default").template
    two = json.dumps([json.loads(call("a", x=1)), json.loads(call("b", y=2))])
    cases = [
        (
            glm,
            conv(("system", "s"), ("human", "q"), ("function_call", two)),
            ds.BAD_FUNCTION_CALL,
            "conversations[3].value",
        ),
        (default, conv(("human", "q"), ("gpt", "a"), tools='[{"name": "f"}]'), ds.BAD_TOOLS, "tools"),
        (
            default,
            conv(("human", "q"), ("function_call", "just words")),
            ds.BAD_FUNCTION_CALL,
            "conversations[2].value",
        ),
    ]
    for template, raw, reason, field in cases:
        row = validate("f", 3, raw, "sharegpt")
        assert not isinstance(row, RowError)
        err = ds.check_with_template("f", 3, raw, row, template)
        assert (err.row, err.reason, err.field) == (3, reason, field), err


@pytest.mark.reliability(
    fault=(
        "tool-calling rows LLaMA-Factory could not use: a `function_call` at a prompt position, an "
        "`observation` after the last answer, `tools` that are not JSON, a call the template's "
        "formatter refuses"
    ),
    seen=(
        "each named with its row number, field and reason (`role_order`, `bad_tools`, `bad_function_call`) "
        "under `invalid_rows: fail` and `drop`, never a traceback"
    ),
    steps_lost="none",
    data_lost="none",
)
@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_prepare_names_every_bad_tool_row(tmp_path, tokenizer_dir, policy):
    good = tool_rows(20)
    bad = [raw for raw, _, _ in BAD] + [conv(("human", "q"), ("function_call", "just words"))]
    rows = good[:10] + bad + good[10:]
    src = write_json(tmp_path / "in.json", rows)
    args = (tmp_path / "out", tokenizer_dir, "default", 4096, 0.3, "s", policy)
    sources = [{"path": str(src), "format": "sharegpt"}]
    if policy == "fail":
        with pytest.raises(DataError) as info:
            prepare(sources, *args)
        message = str(info.value)
        assert f"{len(bad)} bad row(s)" in message
        for number in range(11, 11 + len(bad)):
            assert f"in.json row {number}:" in message
        assert "Traceback" not in message
    else:
        stats = prepare(sources, *args, max_dropped=0.6)
        rejected = read_jsonl(tmp_path / "out" / "rejected.jsonl")
        invalid = [r["row"] for r in rejected if r["reason"] in stats["invalid_by_reason"]]
        assert sorted(invalid) == list(range(11, 11 + len(bad)))
        assert stats["invalid"] == len(bad)
        assert stats["invalid_by_reason"][ds.BAD_FUNCTION_CALL] == 3


def test_existing_plain_rows_keep_their_content_keys():
    """The split of existing datasets does not move: keys computed before tool rows existed."""
    alpaca = {"instruction": "What is the first word?", "input": "cat dog", "output": "cat"}
    assert content_key(alpaca) == "960843b074ac8bcf7a558c53ea7095c3d88f44fb5c3986e66c1b5e5f42bbfcb6"
    multi = validate(
        "f",
        1,
        conv(("system", "Be brief."), ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),
        "sharegpt",
    )
    assert content_key(multi) == "41796d35067c3b489129bce152f26fbe56aaf1dafa7313a1c8939072740c20e6"
    assert content_key(
        validate(
            "f",
            1,
            conv(
                ("system", "Be brief."),
                ("human", "q1"),
                ("gpt", "a1"),
                ("human", "q2"),
                ("gpt", "a2"),
                tools="",
            ),
            "sharegpt",
        )
    ) == content_key(multi)


def test_tool_row_identity_covers_turns_and_tools():
    base = tool_rows(1)[0]
    key = content_key(validate("f", 1, base, "sharegpt"))
    other_call = json.loads(json.dumps(base))
    other_call["conversations"][1]["value"] = call("get_weather", city="Elsewhere")
    spaced = {**base, "tools": json.dumps(json.loads(TOOLS), indent=2)}
    keys = {
        "call": content_key(validate("f", 1, other_call, "sharegpt")),
        "tools": content_key(validate("f", 1, {**base, "tools": json.dumps([WEATHER])}, "sharegpt")),
        "no tools": content_key(validate("f", 1, {**base, "tools": ""}, "sharegpt")),
    }
    assert key not in keys.values() and len(set(keys.values())) == 3
    assert content_key(validate("f", 1, spaced, "sharegpt")) == key  # the same tools, spaced otherwise


@pytest.mark.parametrize("template", TEMPLATES)
def test_evaluation_scores_the_call(tokenizer_dir, template):
    enc = SFTEncoder(tokenizer_dir, template)
    raw = conv(
        ("human", "Weather in Oslo?"),
        ("function_call", call("get_weather", city="Oslo", days=2)),
        tools=TOOLS,
    )
    text_row = validate("f", 2, tool_rows(1)[0], "sharegpt")
    row = validate("f", 1, raw, "sharegpt")
    ref, text_ref = ev.references([row, text_row], template, [enc.tokenizer.eos_token])
    assert text_ref.calls is None and text_ref.text == "It is 0 degrees in Paris0."
    assert ref.calls == [("get_weather", {"city": "Oslo", "days": 2})]
    # The reference is the answer the model was trained on, up to where generation stops.
    _, answer = enc.template.encode_oneturn(enc.tokenizer, conversation.messages(row), None, TOOLS)
    assert enc.tokenizer.decode(answer, skip_special_tokens=True).strip().startswith(ref.text)
    assert ref.exact_match(ref.text) == 1.0
    other_order = ref.text.replace('{"city": "Oslo", "days": 2}', '{"days": 2,  "city": "Oslo"}')
    assert other_order != ref.text and ref.exact_match(other_order) == 1.0  # the same call
    assert ref.exact_match(ref.text.replace("Oslo", "Bergen")) == 0.0
    assert ref.exact_match("It is sunny.") == 0.0
    assert text_ref.exact_match("it is 0 degrees in paris0.") == 1.0


def test_evaluation_encodes_tool_rows_with_llamafactory(tokenizer_dir):
    from llmft.core.lf.prompts import PromptEncoder
    from transformers import AutoTokenizer

    rows = [validate("f", i, raw, "sharegpt") for i, raw in enumerate(tool_rows(5), 1)]
    rows += synthetic_rows(3, seed=1)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    table, _ = PromptEncoder.load(tok, "default")
    assert table is not None and table.encode(rows) is None  # the table declines tool rows
    assert table.encode(rows[5:]) is not None
    tokenizer, encoded = ev.encode(rows, str(tokenizer_dir), "llama3")
    enc = SFTEncoder(tokenizer_dir, "llama3")
    for row, (prompt, answer) in zip(rows, encoded, strict=True):
        ids = enc.encode([row])
        assert prompt + answer == ids.ids.tolist()
        assert ids.labels.tolist()[len(prompt) :] == answer  # the answer is the last turn's


def test_evaluate_end_to_end_reports_the_call_as_reference(tmp_path):
    """evaluate() on held-out tool rows: their prompts through LLaMA-Factory (tools in the system
    turn), a call answer's reference the call as the template formats it, scored on the call."""
    from llmft.core.assets import build_tiny_model
    from llmft.core.config import validate as validate_config
    from llmft.core.io import read_json, write_jsonl
    from llmft.core.settings import Config, replace

    build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=1, num_heads=2, seed=1)
    rows = [validate("f", i, raw, "sharegpt") for i, raw in enumerate(tool_rows(5), 1)]
    write_jsonl(tmp_path / "heldout.jsonl", rows + synthetic_rows(3, seed=2))
    cfg = Config.from_dict(
        validate_config({"eval": {"batch_size": 4, "max_new_tokens": 4, "decoding": "dynamic"}})
    )
    cfg = replace(cfg, "model.template", "default")
    ev.evaluate(
        cfg, str(tmp_path / "model"), str(tmp_path / "heldout.jsonl"), str(tmp_path / "out"), "t", threads=1
    )
    preds = read_jsonl(tmp_path / "out" / "predictions.jsonl")
    metrics = read_json(tmp_path / "out" / "metrics.json")
    assert metrics["rows"] == 8
    assert preds[1]["reference"] == 'Action: get_weather\nAction Input: {"city": "Rome1"}'
    assert preds[0]["reference"] == "It is 0 degrees in Paris0." and preds[0]["prompt"] == '{"temp": 0}'
    assert preds[5]["reference"] == synthetic_rows(3, seed=2)[0]["output"]


@pytest.mark.parametrize("template", ["qwen", "mistral"])
def test_alpaca_rows_with_tools_equal_llamafactory(tokenizer_dir, template):
    from llamafactory.data.converter import AlpacaDatasetConverter
    from llamafactory.data.parser import DatasetAttr
    from llamafactory.data.processor import SupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments

    enc = SFTEncoder(tokenizer_dir, template)
    raw_rows = [
        {"instruction": "Weather?", "input": "Oslo", "output": "Ask the tool.", "tools": TOOLS},
        {"instruction": "q2", "output": "a2", "system": "S", "history": [["q1", "a1"]], "tools": [WEATHER]},
        {"instruction": "q", "output": "a", "tools": ""},
    ]
    rows = [validate("f", i, raw, "alpaca") for i, raw in enumerate(raw_rows, 1)]
    assert (
        "messages" in rows[0]
        and "messages" in rows[1]
        and rows[2] == {"instruction": "q", "input": "", "output": "a"}
    )
    attr = DatasetAttr("file", dataset_name="a", system="system", tools="tools", history="history")
    convert = AlpacaDatasetConverter(attr, DataArguments())
    batch = {k: [] for k in ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")}
    for raw, row in zip(raw_rows, rows, strict=True):
        # LLaMA-Factory reads the tools as a string (a list would reach its formatter undecoded).
        out = convert({"input": None, "system": None, "history": None, **raw, "tools": row.get("tools", "")})
        for k in batch:
            batch[k].append(out[k])
    proc = SupervisedDatasetProcessor(
        template=enc.template,
        tokenizer=enc.tokenizer,
        processor=None,
        data_args=DataArguments(cutoff_len=10**5),
    )
    theirs = proc.preprocess_dataset(batch)
    ours = enc.encode(rows)
    for i in range(len(rows)):
        assert rows_of(ours, i) == (theirs["input_ids"][i], theirs["labels"][i])
