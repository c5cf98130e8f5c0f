"""Hostile image inputs against a real `pagedllm serve` of a vision-language model (issue 45):
each request's status and error message as a markdown table, then a plain image request and a
plain text request that must still succeed, and /metrics' encoder-cache counters.

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.image_refusals --model FOLDER

FOLDER: a multimodal checkpoint folder with its processor (the tests' tiny LLaVA:
`tests.integration.vlm_fixtures.make_tiny_vlm("llava", path)`). The server runs with
`--limit-mm-per-prompt '{"image": 2}' --allowed-media-domains 127.0.0.1 --media-fetch-timeout 2`.
"""

from __future__ import annotations

import argparse
import base64
import io

import httpx

from benchmarks.serve_process import serving


def _png(size=(48, 40), mode="RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 120 if mode != "RGB" else (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def cases() -> list[tuple[str, list]]:
    ok = _url(_png())
    return [
        ("undecodable bytes", [_part(_url(b"not an image at all"))]),
        ("truncated PNG", [_part(_url(_png()[:60]))]),
        ("pixel bomb (5000 x 5000, 3 KB)", [_part(_url(_png((5000, 5000), "1")))]),
        ("not base64", [_part("data:image/png;base64,!!!")]),
        ("text/plain data URL", [_part(_url(b"hello", "text/plain"))]),
        ("three images, limit 2", [_part(ok)] * 3),
        ("remote host not allowed", [_part("https://example.com/cat.png")]),
        ("allowed host, nothing listening (timeout / refused)", [_part("http://127.0.0.1:9/cat.png")]),
        ("file:// without --allowed-local-media-path", [_part("file:///etc/passwd")]),
        ("ftp:// URL", [_part("ftp://127.0.0.1/a.png")]),
        ("video_url part", [{"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}}]),
        ("input_audio part", [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]),
        ("image_url without url", [{"type": "image_url", "image_url": {}}]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    serve_args = [args.model, "--max-model-len", "512", "--kv-cache-space", "0.05", "--limit-mm-per-prompt",
                  '{"image": 2}', "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "2"]
    with serving(serve_args) as base, httpx.Client(base_url=base, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        print("| input | status | message |\n|---|---|---|")

        def ask(content) -> httpx.Response:
            return http.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": content}]})

        for name, parts in cases():
            r = ask([*parts, {"type": "text", "text": "What is it?"}])
            msg = r.json().get("error", {}).get("message", "") if r.status_code != 200 else "(answered)"
            print(f"| {name} | {r.status_code} | {msg.replace('|', '/')[:220]} |")
        r = ask([_part(_url(_png())), {"type": "text", "text": "What is it?"}])
        print(f"| then: a plain image request | {r.status_code} | {r.json()['choices'][0]['message']['content']!r} |")
        r = ask("Hello")
        print(f"| then: a plain text request | {r.status_code} | {r.json()['choices'][0]['message']['content']!r} |")
        metrics = [line for line in http.get("/metrics").text.splitlines()
                   if line.startswith(("vllm:mm_cache", "pagedllm:mm_images_encoded_total", "vllm:num_requests"))]
        print("\n" + "\n".join(metrics))


if __name__ == "__main__":
    main()
