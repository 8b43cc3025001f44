// The Batches page. Each batch.progress event from the socket moves its row's bar and counts at once. A status
// change, or a batch this page has not shown yet, re-reads the list from the server (one small fragment), which
// brings the download links and the Cancel button up to date as well.
(function () {
  "use strict";
  const script = document.currentScript;
  const list = document.getElementById("batch-list");
  const state = document.getElementById("live-state");
  const statuses = JSON.parse(document.getElementById("batch-statuses").textContent);
  const firstPage = script.dataset.firstPage === "1";
  const latest = new Map(); // batch id -> the newest event seen: a re-read list may have been read before it
  let reading = false;
  let again = false;

  const finished = (e) => e.completed + e.failed + e.cancelled;
  const rank = (status) => (status in statuses.rank ? statuses.rank[status] : -1);
  const width = (n, total) => (total > 0 ? ((100 * n) / total).toFixed(2) : "0") + "%";
  const rowOf = (id) => list.querySelector('tr[data-batch-id="' + CSS.escape(id) + '"]');

  // Events from several worker threads can arrive out of order: counts only grow and statuses only move
  // forward, so an older event never moves a row back. Returns whether the row's status moved.
  function patch(row, e) {
    if (finished(e) >= Number(row.dataset.finished) && e.total >= Number(row.dataset.total)) {
      const pct = e.total > 0 ? Math.floor((100 * finished(e)) / e.total) : 0;
      Object.assign(row.dataset, { finished: finished(e), total: e.total, percent: pct });
      const bar = row.querySelector(".bar");
      bar.setAttribute("aria-valuenow", pct);
      for (const kind of ["completed", "failed", "cancelled"]) {
        bar.querySelector(".seg." + kind).style.width = width(e[kind], e.total);
        row.querySelector(".n-" + kind).textContent = e[kind];
      }
      row.querySelector(".pct").textContent = pct + "%";
      row.querySelector(".n-finished").textContent = finished(e);
      row.querySelector(".n-total").textContent = e.total;
    }
    if (rank(e.status) <= rank(row.dataset.status)) return false;
    row.dataset.status = e.status;
    const badge = row.querySelector(".badge");
    badge.dataset.status = e.status;
    badge.textContent = statuses.labels[e.status] || e.status;
    return true;
  }

  // One read at a time; events during a read ask for one more after it.
  async function reread() {
    if (reading) { again = true; return; }
    reading = true;
    list.setAttribute("aria-busy", "true");
    try {
      const answer = await fetch(location.pathname + location.search, { headers: { "HX-Request": "true" } });
      if (answer.ok) {
        const html = await answer.text();
        const holder = document.createElement("div");
        holder.innerHTML = html;
        holder.querySelector("#batch-message")?.remove(); // the page's message stays until the next action
        list.replaceChildren(...holder.childNodes);
        htmx.process(list);
        // The list was read after the events that asked for it, but later events may have arrived meanwhile.
        for (const e of latest.values()) {
          const row = rowOf(e.batch_id);
          if (row && patch(row, e)) again = true;
          if (rank(e.status) === statuses.rank.completed) latest.delete(e.batch_id); // nothing comes after
        }
      }
    } catch (err) {
      // Offline: the socket's reconnect re-reads the list.
    } finally {
      reading = false;
      list.removeAttribute("aria-busy");
      if (again) { again = false; reread(); }
    }
  }

  function onProgress(e) {
    const seen = latest.get(e.batch_id);
    if (!seen || finished(e) >= finished(seen) || rank(e.status) > rank(seen.status)) latest.set(e.batch_id, e);
    const row = rowOf(e.batch_id);
    if (!row) {
      if (firstPage) reread(); // a new batch: it belongs at the top of the newest page
      return;
    }
    if (patch(row, e)) reread();
  }

  function connect(delay) {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(proto + location.host + script.dataset.socket);
    socket.onopen = () => {
      state.dataset.state = "live"; state.textContent = "live"; delay = 1000;
      reread(); // whatever changed before this socket joined (page load, or while offline)
    };
    socket.onmessage = (m) => { const msg = JSON.parse(m.data); if (msg.type === "batch.progress") onProgress(msg); };
    socket.onclose = () => {
      state.dataset.state = "offline"; state.textContent = "reconnecting…";
      setTimeout(() => connect(Math.min(delay * 2, 30000)), delay);
    };
  }

  connect(1000);
})();
