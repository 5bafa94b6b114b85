"""Text- and chat-level prompts: the agent's tokenizer and chat template are applied, sampling
defaults come from the agent's config, bad values get one message naming node and agent."""

import pytest

from flexmarl.config.schema import AgentConfig, config_from_dict
from flexmarl.graph.chat import PromptError, PromptRenderer, stop_cut
from flexmarl.graph.meg import EpisodeContext, GraphError, NodePrompt, TextPrompt
from flexmarl.policy.tokenizer import TokenizerError, byte_tokenizer


def _renderer(vocab=320, **sampling):
    agents = {"writer": AgentConfig.model_validate({"sampling": sampling}),
              "reader": AgentConfig()}
    return PromptRenderer(agents, vocab)


def test_chat_messages_go_through_the_agents_chat_template():
    r = _renderer(max_tokens=7, stop=["."], stop_token_ids=[9])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    prompt, is_text = r.render("ask", "writer", messages)
    tok = byte_tokenizer()
    assert is_text
    assert tok.decode(prompt.tokens) == "<|system|>Be brief.</s><|user|>2+2?</s><|assistant|>"
    assert prompt.tokens == tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    # the agent's sampling defaults; the tokenizer's end-of-sequence token always stops
    assert prompt.max_new_tokens == 7 and prompt.stop == ["."]
    assert prompt.stop_tokens == [9, tok.eos_token_id] and prompt.allowed_tokens is None


def test_plain_text_and_node_level_overrides():
    r = _renderer(max_tokens=7, stop=["."])
    prompt, is_text = r.render("ask", "writer", TextPrompt("abc", max_new_tokens=3, stop="!"))
    assert is_text and byte_tokenizer().decode(prompt.tokens) == "abc"
    assert prompt.max_new_tokens == 3 and prompt.stop == [".", "!"]
    # a NodePrompt passes through untouched: token-level nodes stay token-level
    raw = NodePrompt([1, 2], 4, [5, 6])
    assert r.render("ask", "writer", raw) == (raw, False)


@pytest.mark.parametrize("value, fragment", [
    (42, "returned int; expected a NodePrompt (token ids), a string, a list of chat messages"),
    ([1, 2, 3], "returned a list of token ids, not NodePrompt"),
    ([{"role": "user"}], "item #0 is {'role': 'user'}; chat messages are dicts"),
    ([], "returned an empty list"),
    ("", "returned an empty string"),
    (TextPrompt("x", stop=[3]), "TextPrompt.stop[0] is 3 (int); a stop string must be a "
                                "non-empty string"),
    (TextPrompt("x", stop=5), "TextPrompt.stop must be a string or a list of strings, got int"),
    (TextPrompt("x", max_new_tokens=0), "TextPrompt.max_new_tokens is 0"),
    (NodePrompt([1], 2, stop=[""]), "NodePrompt.stop[0] is ''"),
])
def test_bad_prompt_values_name_node_and_agent(value, fragment):
    with pytest.raises(PromptError) as err:
        _renderer().render("ask", "writer", value)
    assert str(err.value).startswith("node 'ask' (agent 'writer'): prompt builder")
    assert fragment in str(err.value)


def test_byte_tokenizer_needs_room_in_the_random_models_vocabulary():
    with pytest.raises(TokenizerError, match="agent 'writer': its tokenizer has 261 tokens but "
                                             "the model's vocabulary has 64"):
        _renderer(vocab=64).render("ask", "writer", "hello")


def test_stop_strings_in_the_config_must_be_non_empty_strings():
    base = {"task": {"builder": "x:y"}, "agents": {"a": {"sampling": {"stop": ["ok", ""]}}}}
    with pytest.raises(Exception, match=r"agents.a.sampling.stop.1: String should have at "
                                        "least 1 character"):
        config_from_dict(base)
    base["agents"]["a"]["sampling"]["stop"] = ["ok", 3]
    with pytest.raises(Exception, match=r"agents.a.sampling.stop.1: Input should be a valid "
                                        "string"):
        config_from_dict(base)


def test_decoded_text_is_cut_before_the_first_stop_string():
    r = _renderer()
    tok = byte_tokenizer()
    ids = tok.encode("12\nnext line", add_special_tokens=False) + [tok.eos_token_id]
    assert r.decode("writer", ids, ["\n"]) == "12"
    assert r.decode("writer", ids, []) == "12\nnext line"  # special tokens skipped
    assert stop_cut("a;b.c", [".", ";"]) == ("a", True)
    assert stop_cut("abc", ["x"]) == ("abc", False)


def test_text_of_a_token_level_node_is_an_error_naming_it():
    ctx = EpisodeContext("0-0", 0, {}, outputs={"speak": [3]}, texts={})
    with pytest.raises(GraphError, match="node 'speak' is token-level"):
        ctx.text("speak")
    ctx.texts["speak"] = "hi"
    assert ctx.text("speak") == "hi" and ctx.output("speak") == [3]
