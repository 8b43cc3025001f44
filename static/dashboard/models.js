// The Models page: the playground streams a reply over fetch() (server-sent events, session + CSRF token), and
// the operator forms say they are saving while the page reloads.
(function () {
  "use strict";

  document.querySelectorAll("form[data-loading]").forEach((form) => {
    form.addEventListener("submit", () => {
      const button = form.querySelector("button[type=submit]");
      button.disabled = true;
      button.textContent = "Saving…";
    });
  });

  const form = document.getElementById("playground-form");
  if (!form) return;
  const section = document.getElementById("playground");
  const $ = (id) => document.getElementById(id);
  const reply = $("pg-reply"), status = $("pg-status"), error = $("pg-error"), stats = $("pg-stats");
  const run = $("pg-run"), stop = $("pg-stop"), model = $("pg-model");
  let controller = null;

  const plain = (text) => (text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text);
  const duration = (ms) => (ms === null || ms === undefined ? "–"
    : ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : Math.round(ms) + " ms");

  function setState(state, text) {
    section.dataset.state = state;
    status.textContent = text;
    run.disabled = state === "waiting" || state === "streaming";
    stop.disabled = !run.disabled;
    run.textContent = run.disabled ? "Running…" : "Run";
  }

  function fail(message) {
    error.textContent = message;
    error.hidden = false;
    setState("error", "");
  }

  function showHint() {
    const chat = model.selectedOptions[0] && model.selectedOptions[0].dataset.chat === "1";
    $("pg-system-hint").textContent = chat ? "(sent as the system message)"
      : "(this model has no chat template: the system text goes before the message in one plain prompt)";
  }
  model.addEventListener("change", showHint);
  showHint();

  function number(id) {
    const raw = $(id).value.trim();
    if (raw === "") return null;
    const value = Number(raw);
    return Number.isFinite(value) ? value : raw; // the server explains what is wrong with it
  }

  function finish(done) {
    const usage = done.usage;
    $("pg-input-tokens").textContent = usage.input_tokens;
    $("pg-cached-tokens").textContent = usage.cached_input_tokens;
    $("pg-output-tokens").textContent = usage.output_tokens;
    $("pg-latency").textContent = duration(done.latency_ms);
    $("pg-ttft").textContent = duration(done.ttft_ms);
    $("pg-neurons").textContent = plain(done.neurons);
    $("pg-cost").textContent = "$" + plain(done.cost_usd);
    const spec = done.speculation;
    $("pg-spec").textContent = spec.proposed ? spec.accepted + " of " + spec.proposed + " draft tokens accepted" : "";
    stats.hidden = false;
    if (done.parsed) {
      $("pg-parsed").textContent = JSON.stringify(done.parsed, null, 2);
      $("pg-parsed-section").hidden = false;
    }
    setState("done", done.finish_reason === "length" ? "Done (stopped at max tokens)" : "Done");
  }

  function handle(event) {
    if (event.type === "token") {
      if (section.dataset.state === "waiting") setState("streaming", "Streaming…");
      reply.textContent += event.text;
    } else if (event.type === "done") {
      finish(event);
    } else if (event.type === "error") {
      fail(event.message);
    }
  }

  async function readError(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (err) { /* not JSON: Django's own CSRF or server error page */ }
    if (response.status === 403) return "The request was refused (403): reload the page and try again.";
    return "The request failed (" + response.status + "). Try again in a moment.";
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.hidden = true;
    reply.textContent = "";
    reply.hidden = false;
    stats.hidden = true;
    $("pg-parsed-section").hidden = true;
    setState("waiting", "Waiting for the first token…");
    controller = new AbortController();
    const body = {
      model: model.value, system: $("pg-system").value, message: $("pg-message").value,
      max_tokens: number("pg-max-tokens"), temperature: number("pg-temperature"),
      json_schema: $("pg-json-schema").value, tools: $("pg-tools").value,
    };
    try {
      const response = await fetch(form.dataset.url, {
        method: "POST", credentials: "same-origin", signal: controller.signal, body: JSON.stringify(body),
        headers: { "Content-Type": "application/json", "Accept": "text/event-stream",
                   "X-CSRFToken": form.querySelector("[name=csrfmiddlewaretoken]").value },
      });
      if (!response.ok) {
        reply.hidden = true;
        fail(await readError(response));
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const chunk = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          if (chunk.startsWith("data: ")) handle(JSON.parse(chunk.slice(6)));
        }
      }
      if (section.dataset.state === "waiting" || section.dataset.state === "streaming") {
        fail("The reply ended early. Try again.");
      }
    } catch (err) {
      if (err.name === "AbortError") {
        setState("stopped", "Stopped. The tokens generated so far are billed.");
      } else {
        fail("The connection failed: " + err.message);
      }
    } finally {
      controller = null;
    }
  });

  stop.addEventListener("click", () => {
    if (controller) controller.abort();
  });
})();
