"""Greedy parity cases shared by the per-architecture VLM tests (test_vlm_idefics3.py,
test_vlm_llava_next.py): prompts with one image, two images of different sizes, none; each
prompt's transformers float32 greedy continuation (vlm_fixtures.hf_greedy) is the reference, read
from the reference store (`vlm_greedy_cases.<model_type>`, tests/references.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.integration import vlm_fixtures as vf

MAX_TOKENS = 8
# Image sizes (width, height) that give different tile / crop layouts under every fixture's processor.
WIDE = (80, 30)
SQUARE = (48, 40)


@dataclass
class Case:
    prompt: str
    images: list
    expected: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)

    def request(self):
        return {"prompt": self.prompt, "multi_modal_data": {"image": self.images}} if self.images else self.prompt


def cases(path: str) -> dict[str, Case]:
    """one_a / one_b: two different images alone (their outputs must differ); two: a square and
    a wide image in one prompt; text: no image."""
    a, b = vf.sample_images(2, seed=1, size=SQUARE)
    (wide,) = vf.sample_images(1, seed=2, size=WIDE)
    text_only = vf.chat_prompt(path, [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}])
    out = {"one_a": Case(vf.chat_prompt(path, vf.user_turn("What is this?")), [a]),
           "one_b": Case(vf.chat_prompt(path, vf.user_turn("What is this?")), [b]),
           "two": Case(vf.chat_prompt(path, vf.user_turn("Compare them.", 2)), [a, wide]),
           "text": Case(text_only, [])}
    expected = vf.stored_greedy(f"vlm_greedy_cases.{model_type(path)}", path,
                                [(c.prompt, c.images) for c in out.values()], MAX_TOKENS)
    for c, want in zip(out.values(), expected, strict=True):
        c.expected = want
        c.prompt_ids = vf.hf_prompt_ids(path, c.prompt, c.images)
    return out


def model_type(path: str) -> str:
    import json

    with open(f"{path}/config.json", encoding="utf-8") as f:
        return json.load(f)["model_type"]


def greedy(llm, chosen: list[Case]) -> list[list[int]]:
    from pagedllm import SamplingParams

    outs = llm.generate([c.request() for c in chosen], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def image_spans(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """[first, last + 1) of the placeholder positions between an image's first and last run."""
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    return [(positions[0], positions[-1] + 1)] if positions else []


def features(path: str, case: Case):
    """The engine front end's features of a case (multimodal/processing.py)."""
    import json

    from transformers import AutoConfig

    from pagedllm.multimodal.processing import MultiModalProcessor

    with open(f"{path}/config.json", encoding="utf-8") as f:
        arch = json.load(f)["architectures"][0]
    processor = MultiModalProcessor(path, AutoConfig.from_pretrained(path), arch)
    ids, feats = processor.process(case.prompt, {"image": case.images})
    assert not case.prompt_ids or ids == case.prompt_ids  # the engine expands as transformers does
    return feats
