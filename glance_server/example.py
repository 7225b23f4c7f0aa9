"""Print a ready-to-paste curl example for a running gateway (``make serve`` shows it before starting)."""

from __future__ import annotations

import argparse
import base64
import io
import json

from glance_sgl.demo.tasks import Example, eval_set

EXAMPLE_TASK, EXAMPLE_INDEX = "caption", 2  # an evaluation scene the bundled demo VLM describes correctly


def example() -> Example:
    """The demo scene (image, prompt, reference answer) the printed request uses."""
    return eval_set(EXAMPLE_TASK)[EXAMPLE_INDEX]


def example_image_data_url() -> str:
    """The example scene as a PNG data URL."""
    buf = io.BytesIO()
    example().image.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def curl_example(base_url: str, model: str = "glance-demo") -> str:
    body = {"model": model, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": example_image_data_url()}},
                {"type": "text", "text": example().prompt}]}],
            "glance": {"measure_speedup": True}}
    return (f"curl -s {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"  -d '{json.dumps(body)}' | python3 -m json.tool")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="glance-demo")
    args = parser.parse_args()
    base = f"http://{args.host}:{args.port}"
    print("When the server logs 'Application startup complete', try (in another shell):\n")
    print(curl_example(base, args.model))
    print(f"\nThe bundled demo VLM should answer: {example().answer}")
    print("\nor the multipart endpoint with your own picture:\n")
    print(f"curl -s {base}/v1/generate -F image=@picture.png -F prompt='Describe the image.' -F max_tokens=64\n")
    print(f"Metrics: curl -s {base}/metrics | grep ^glance_   Readiness: curl -s {base}/ready\n", flush=True)


if __name__ == "__main__":
    main()
