"""Data items of a visual task (``dataset.train_path=builtin:<visual task>``, :mod:`areal_cli.data.builtin_vision`).

A row's image(s) ride in the item (``"images"``: PNG bytes, in prompt order) beside a chat whose user turn
holds one image part per image and the question::

    {"id", "question", "images": [b"\\x89PNG..."],
     "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": <question>}]}],
     "prompt": <the chat rendered with one <|image_pad|> per image>, "prompt_len": <tokens, images counted>,
     "answer": <reference>, "solution": <worked answer, the SFT target>}

No ``prompt_ids``: the rollout renders the chat and expands each image's pads itself
(:mod:`areal_cli.rollout.images`), where the pixels are computed too (kept out of the item: 2000 items of
pixel values would be ~200 MB). ``prompt_len`` counts each image as the tokens the processor gives it, and
``dataset.max_prompt_len`` applies to that; ``dataset.max_image_pixels`` skips a row with a larger image.
"""

from __future__ import annotations

from typing import Any

from areal_cli.data.datasets import DataReport, extract_answer


def image_size(img: Any) -> tuple[int, int]:
    """(width, height) read from the image's header."""
    from areal_cli.rollout.images import to_pil

    pil = to_pil(img)
    return pil.width, pil.height


def build_vision_items(rows: list[dict], tokenizer: Any, *, system_prompt: str | None = None,
                       max_prompt_len: int | None = None, max_image_pixels: int | None = None,
                       source: str = "<rows>") -> tuple[list[dict], DataReport]:
    from areal_cli.rollout.images import image_token_count, item_images

    report = DataReport(path=source, total=len(rows))
    items: list[dict] = []
    tokens_of: dict[tuple[int, int], int] = {}
    for i, row in enumerate(rows):
        q = row.get("question")
        imgs = item_images(row)
        ref = extract_answer(row.get("answer"))
        if not isinstance(q, str) or not q.strip():
            report.skip(i, "missing/empty 'question'")
            continue
        if not imgs:
            report.skip(i, "no image")
            continue
        if ref is None:
            report.skip(i, "missing/unparseable 'answer'")
            continue
        sizes = [image_size(im) for im in imgs]
        if max_image_pixels is not None and any(w * h > max_image_pixels for w, h in sizes):
            report.skip(i, "image larger than dataset.max_image_pixels")
            continue
        content = [{"type": "image"} for _ in imgs] + [{"type": "text", "text": q}]
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": content}]
        prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        n_text = len(tokenizer.encode(prompt, add_special_tokens=False)) - len(imgs)
        for s in sizes:
            if s not in tokens_of:
                tokens_of[s] = image_token_count(tokenizer, *s)
        n = n_text + sum(tokens_of[s] for s in sizes)
        if max_prompt_len is not None and n > max_prompt_len:
            report.skip(i, "prompt longer than dataset.max_prompt_len (image tokens counted)")
            continue
        answer = row.get("answer")
        items.append({"id": str(row.get("id", f"{source}-{i}")), "question": q, "images": [bytes(im) if
                      isinstance(im, (bytes, bytearray)) else im for im in imgs], "messages": msgs,
                      "prompt": prompt, "prompt_len": n, "answer": ref, "colour": row.get("colour"),
                      "solution": answer if isinstance(answer, str) else str(answer)})
    report.kept = len(items)
    return items, report
