"""`GET /`: a small page that asks the server for an image and shows its partial images as they
arrive (the stream read with `fetch`, since the browser's EventSource cannot POST). Served by
the app itself, so the browser needs no cross-origin permission."""

PAGE = """<!doctype html>
<html lang="en">
<meta charset="utf-8">
<title>specdec serve</title>
<style>
  body { font: 15px system-ui, sans-serif; margin: 2em; max-width: 46em; }
  img { width: 256px; height: 256px; image-rendering: pixelated; background: #ddd; margin-right: 1em; }
  label { margin-right: 1em; }
  #log { font: 12px monospace; white-space: pre-wrap; color: #444; }
</style>
<h1>specdec serve</h1>
<p>
  <label>class <select id="cls"></select></label>
  <label>method <select id="method"></select></label>
  <label>seed <input id="seed" type="number" value="0" min="0" style="width: 6em"></label>
  <label>partial images <input id="partials" type="number" value="3" min="0" max="3" style="width: 3em"></label>
  <button id="go">generate</button>
</p>
<p><img id="image" alt=""><span id="status"></span></p>
<div id="log"></div>
<script>
const $ = (id) => document.getElementById(id);
const log = (line) => { $("log").textContent += line + "\\n"; };

async function start() {
  const card = (await (await fetch("/v1/models")).json()).data[0];
  for (const [i, name] of (card.specdec.classes || []).entries()) $("cls").add(new Option(name, i));
  for (const m of card.specdec.methods) $("method").add(new Option(m, m, false, m === card.specdec.default_method));
}

async function generate() {
  $("log").textContent = "";
  const started = performance.now();
  const body = {prompt: $("cls").selectedOptions[0].text, method: $("method").value, seed: Number($("seed").value),
                stream: true, partial_images: Number($("partials").value)};
  const response = await fetch("/v1/images/generations", {method: "POST", body: JSON.stringify(body),
                                                           headers: {"content-type": "application/json"}});
  if (!response.ok) { log(JSON.stringify(await response.json())); return; }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\\n\\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\\n").find((line) => line.startsWith("data: "));
      if (!data) continue;
      const event = JSON.parse(data.slice(6));
      const ms = (performance.now() - started).toFixed(0);
      if (event.b64_json) $("image").src = "data:image/" + event.output_format + ";base64," + event.b64_json;
      if (event.type === "image_generation.partial_image") log(ms + " ms: partial image " + event.partial_image_index);
      else if (event.type === "image_generation.completed") {
        const s = event.specdec.images[0];
        log(ms + " ms: image, " + s.target_passes + " target passes, acceptance " + s.acceptance);
      } else log(ms + " ms: " + JSON.stringify(event));
    }
  }
}

$("go").onclick = generate;
start().then(() => { if (location.hash === "#generate") generate(); });   // (a link that starts one)
</script>
</html>
"""

__all__ = ["PAGE"]
