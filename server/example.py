"""Print a ready-to-paste curl example for a running gateway (``make serve`` shows it before starting)."""

from __future__ import annotations

import argparse
import base64
import io
import json

from PIL import Image, ImageDraw


def example_image_data_url() -> str:
    """A small PNG (a red circle and a blue square on white) as a data URL."""
    img = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(img)
    draw.ellipse((10, 10, 50, 50), fill=(220, 30, 30))
    draw.rectangle((60, 60, 100, 100), fill=(30, 60, 220))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def curl_example(base_url: str, model: str = "glance-demo") -> str:
    body = {"model": model, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": example_image_data_url()}},
                {"type": "text", "text": "What shapes are in the picture, and what colour is each?"}]}],
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
    print("\nor the multipart endpoint with your own picture:\n")
    print(f"curl -s {base}/v1/generate -F image=@picture.png -F prompt='Describe the picture' -F max_tokens=64\n")
    print(f"Metrics: curl -s {base}/metrics | grep ^glance_   Readiness: curl -s {base}/ready\n", flush=True)


if __name__ == "__main__":
    main()
