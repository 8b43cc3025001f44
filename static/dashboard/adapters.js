// The LoRA adapters page. The upload goes over XMLHttpRequest because fetch() cannot report upload progress:
// the bar follows xhr.upload's progress events, then waits for the server to check the adapter. Deletes ask for
// a confirmation and go over fetch(). Both answers carry the re-rendered list, which replaces the old one in
// place; a refusal comes back as {"error": {"message"}} and is shown next to the form, whose values stay.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const list = $("adapter-list");
  const message = $("adapter-message");

  // A refusal's message; Django's own pages (CSRF failure, sign-in expired) are not JSON.
  function reason(status, body) {
    if (body && body.error && body.error.message) return body.error.message;
    if (status === 403) return "The request was refused (403): reload the page and try again.";
    if (status === 413) return "The upload is too large.";
    return "The request failed (" + status + "). Try again in a moment.";
  }

  function say(kind, text) {
    const line = document.createElement("p");
    line.className = kind;
    line.setAttribute("role", kind === "error" ? "alert" : "status");
    line.textContent = text;
    message.replaceChildren(line);
  }

  // ---------------------------------------------------------------------------------------------- upload
  const form = $("upload-form");
  if (form) {
    const section = $("upload"), bar = $("ad-bar"), percent = $("ad-percent"), status = $("ad-status");
    const error = $("ad-error"), submit = $("ad-submit");

    function setState(state, text) {
      section.dataset.state = state;
      status.textContent = text;
      submit.disabled = state === "uploading" || state === "checking";
    }

    function show(pct) {
      pct = Math.max(Number(bar.getAttribute("aria-valuenow")), Math.min(100, Math.floor(pct)));
      bar.setAttribute("aria-valuenow", pct);
      bar.firstElementChild.style.width = pct + "%";
      percent.textContent = pct + "%";
    }

    form.addEventListener("submit", (event) => {
      event.preventDefault();
      error.hidden = true;
      message.replaceChildren();
      bar.setAttribute("aria-valuenow", 0);
      show(0);
      $("ad-progress").hidden = false;
      setState("uploading", "Uploading…");

      const xhr = new XMLHttpRequest();
      xhr.open("POST", form.getAttribute("action")); // not form.action: the "action" input shadows it
      xhr.responseType = "json"; // null when the answer is not JSON
      xhr.setRequestHeader("Accept", "application/json");
      xhr.setRequestHeader("X-CSRFToken", form.querySelector("[name=csrfmiddlewaretoken]").value);
      xhr.upload.addEventListener("progress", (e) => {
        if (e.lengthComputable && e.total > 0) show((100 * e.loaded) / e.total);
      });
      xhr.upload.addEventListener("load", () => {
        show(100); // every byte has left the browser
        setState("checking", "Checking the adapter…");
      });
      xhr.addEventListener("load", () => {
        const body = xhr.response;
        if (xhr.status === 201 && body && typeof body.list === "string") {
          list.innerHTML = body.list;
          const base = $("ad-base-model").value; // the next adapter is likely for the same model
          form.reset();
          $("ad-base-model").value = base;
          setState("done", "Uploaded " + body.adapter.name + ".");
          return;
        }
        error.textContent = reason(xhr.status, body);
        error.hidden = false;
        setState("error", "");
      });
      xhr.addEventListener("error", () => {
        error.textContent = "The connection failed before the upload finished. Try again.";
        error.hidden = false;
        setState("error", "");
      });
      xhr.send(new FormData(form));
    });
  }

  // ---------------------------------------------------------------------------------------------- delete
  list.addEventListener("submit", async (event) => {
    const target = event.target.closest("form.delete-form");
    if (!target) return;
    event.preventDefault();
    if (!confirm("Delete " + target.dataset.name + "? Requests that name it will fail from now on.")) return;
    const button = target.querySelector("button");
    button.disabled = true;
    try {
      const response = await fetch(target.getAttribute("action"), {
        method: "POST", credentials: "same-origin", body: new FormData(target),
        headers: { "Accept": "application/json" },
      });
      let body = null;
      try { body = await response.json(); } catch (err) { /* not JSON: a Django error page */ }
      if (response.ok && body && typeof body.list === "string") {
        list.innerHTML = body.list;
        say("notice", "Deleted " + target.dataset.name + ".");
      } else {
        say("error", reason(response.status, body));
        button.disabled = false;
      }
    } catch (err) {
      say("error", "The connection failed: " + err.message);
      button.disabled = false;
    }
  });
})();
