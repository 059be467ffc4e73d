"""Tool-call parsers on real model-style outputs, malformed ones and calls inside <think>."""

import json

import pytest

from areal_cli.inference.server.tool_parsers import parse_tool_calls, parser_for_model_type

QWEN_ONE = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
QWEN_TWO = ('Let me compute both.\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TAG = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
             '{"name": "add", "parameters": {"a": 5, "b": 6}}')

# (parser, text, expected [(name, args)], expected content, parse error expected)
TABLE = [
    ("hermes", QWEN_ONE, [("add", {"a": 2, "b": 3})], None, False),
    ("qwen25", QWEN_TWO, [("add", {"a": 1, "b": 2}), ("mul", {"a": 3, "b": 4})], "Let me compute both.",
     False),
    ("hermes", "The answer is 5.", [], "The answer is 5.", False),
    # bad JSON
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>', [], None, True),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2}}', [], None, True),  # cut off
    ("hermes", '<tool_call>\n{"arguments": {"a": 2}}\n</tool_call>', [], None, True),  # no name
    ("hermes", '<tool_call>\n["add", 1]\n</tool_call>', [], None, True),  # not an object
    ("hermes", ('<think>maybe <tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call></think>'
                'The answer is 5.'),
     [], None, False),  # a call only thought about
    ("hermes", '<think>I should add.</think>\n' + QWEN_ONE, [("add", {"a": 2, "b": 3})],
     "<think>I should add.</think>", False),
    ("hermes", '<think>still thinking <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>', [], None,
     False),  # unterminated think: all reasoning
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', [("add", {"a": 1})],
     None, False),  # arguments already a JSON string
    ("llama3_json", LLAMA_ONE, [("get_weather", {"city": "Paris"})], None, False),
    ("llama3_json", LLAMA_TAG, [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})], None, False),
    ("llama3_json", "Paris is sunny today.", [], "Paris is sunny today.", False),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', [], None, True),  # truncated
    ("llama3_json", '{"name": "f", "parameters": {}} trailing words', [], None, True),
    ("llama3_json", '<think>{"name": "f", "parameters": {}}</think>It is 5.', [], None, False),
]


@pytest.mark.parametrize("parser, text, calls, content, failed", TABLE)
def test_parser_table(parser, text, calls, content, failed):
    out = parse_tool_calls(text, parser)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls]
    assert got == calls
    if failed:
        assert out.error and out.content == text  # the raw text, never an exception
    else:
        assert out.error is None
    if not calls:
        assert out.content == text
    else:
        assert out.content == content
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in out.tool_calls)
        assert len({c["id"] for c in out.tool_calls}) == len(out.tool_calls)


def test_parser_per_model_family():
    assert parser_for_model_type("qwen2") == "hermes"
    assert parser_for_model_type("llama") == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        parse_tool_calls("x", "mistral-nope")


def test_calculator_tool_and_sft_transcript(tiny_model_dir):
    """The built-in agent task's tool, answer reading, and its SFT examples: prompt + target is exactly
    the chat template's rendering of a correct tool-use transcript, of the plain task, or of an answer
    given without calling the offered tool."""
    from transformers import AutoTokenizer

    from areal_cli.rollout.workflows.calculator import CALCULATOR, CalculatorAgent, calculate, final_number

    assert (calculate("17+25"), calculate(" 9 - 4 "), calculate("3*4")) == ("42", "5", "12")
    for bad in ("2**100", "1/0", "__import__('os')", None, 5):
        assert calculate(bad).startswith("error")
    assert final_number("The answer is 42.") == "42" and final_number("no idea") is None
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    kinds = set()
    for name in ("Ana", "Tom", "Sam", "Mia", "Leo", "Eva"):
        item = {"question": f"{name} has 17 apples and buys 25 more. How many apples does {name} have now?",
                "answer": "42", "solution": "17+25=42\n#### 42"}  # the shape of data/datasets.py items
        ex = CalculatorAgent(sft_mix=(1, 1, 1)).sft_example(item, tok)
        text = tok.decode(ex["prompt_ids"]) + ex["target"] + tok.eos_token
        user = [{"role": "user", "content": item["question"]}]
        if "<tools>" not in tok.decode(ex["prompt_ids"]):  # the plain task: the worked solution, no tool
            kinds.add("plain")
            assert text == tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False) \
                + "17+25=42\n#### 42" + tok.eos_token
            continue
        if "<tool_call>" not in ex["target"]:  # the tool offered, answered without calling it
            kinds.add("head")
            assert text == tok.apply_chat_template(user, tools=[CALCULATOR], add_generation_prompt=True,
                                                   tokenize=False) + "The sum is 42." + tok.eos_token
            continue
        kinds.add("transcript")
        call = {"id": "c", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "17+25"}}}
        want = tok.apply_chat_template(user + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                               {"role": "tool", "tool_call_id": "c", "content": "42"},
                                               {"role": "assistant", "content": "The answer is 42."}],
                                       tools=[CALCULATOR], tokenize=False)
        assert text == want.rstrip("\n")
        parsed = parse_tool_calls(ex["target"].split("<|im_end|>")[0], "hermes")
        assert parsed.tool_calls[0]["function"]["name"] == "calculator"
    assert kinds == {"plain", "transcript", "head"}
    # the shaped reward of a failed episode: operand_credit per operand in the reference's place
    shaped, ref = CalculatorAgent(operand_credit=0.25), {"solution": "17+25=42\n#### 42"}
    assert [shaped._partial(e, ref) for e in ("17+3", "4+25", "25+17", "17+25", "x", None)] \
        == [0.25, 0.25, 0.0, 0.5, 0.0, 0.0]
    assert CalculatorAgent()._partial("17+3", ref) == 0.0
