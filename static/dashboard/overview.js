// The overview: render the snapshot the page came with, then every snapshot the server pushes over the socket.
(function () {
  "use strict";
  const script = document.currentScript;
  const initial = JSON.parse(document.getElementById("overview-snapshot").textContent);
  const state = document.getElementById("live-state");
  const none = (x) => x === null || x === undefined;
  const pct = (x) => (none(x) ? "–" : (x * 100).toFixed(1) + "%");
  const ms = (x) => (none(x) ? "–" : x < 10 ? x.toFixed(1) : String(Math.round(x)));
  const pair = (a, b) => (none(a) ? "–" : b >= 1000 ? (a / 1000).toFixed(2) + " / " + (b / 1000).toFixed(2) + " s"
                                                  : ms(a) + " / " + ms(b) + " ms");
  const set = (id, text) => { document.getElementById(id).textContent = text; };

  const traffic = new Chart(document.getElementById("usage-chart"), {
    type: "bar",
    data: {
      labels: initial.series.labels,
      datasets: [
        { label: "Requests", data: initial.series.requests, backgroundColor: "#e8772e", yAxisID: "requests" },
        { label: "Tokens", data: initial.series.tokens, type: "line", borderColor: "#3b6fb6", pointRadius: 0,
          tension: 0.2, yAxisID: "tokens" },
      ],
    },
    options: {
      animation: false, maintainAspectRatio: false, interaction: { mode: "index", intersect: false },
      scales: {
        x: { ticks: { maxTicksLimit: 8 } },
        requests: { position: "left", beginAtZero: true, ticks: { precision: 0 }, title: { display: true, text: "requests" } },
        tokens: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, title: { display: true, text: "tokens" } },
      },
    },
  });

  const line = (label, color, dash) => ({ label, data: [], borderColor: color, backgroundColor: color, pointRadius: 2,
                                          spanGaps: true, borderDash: dash || [] });
  const latency = new Chart(document.getElementById("latency-chart"), {
    type: "line",
    data: { labels: [], datasets: [line("p50 latency", "#3b6fb6"), line("p95 latency", "#b3261e"),
                                   line("p95 time to first token", "#e8772e", [4, 3])] },
    options: {
      animation: false, maintainAspectRatio: false, interaction: { mode: "index", intersect: false },
      scales: { x: { ticks: { maxTicksLimit: 8 } }, y: { beginAtZero: true, title: { display: true, text: "ms" } } },
    },
  });

  function renderEngines(engines) {
    const body = document.querySelector("#engines tbody");
    body.replaceChildren(...engines.map((e) => {
      const row = document.createElement("tr");
      const meter = document.createElement("meter");
      meter.min = 0; meter.max = 1; meter.value = e.kv_usage;
      const cells = [e.model, e.replica, null, e.running, e.queue_depth,
        Math.round(e.prefix_cache_hit_rate * 100) + "%", e.tokens_per_s.toFixed(1)].map((text) => {
        const td = document.createElement("td");
        if (text !== null) td.textContent = text;
        return td;
      });
      cells[2].append(meter, " " + Math.round(e.kv_usage * 100) + "%");
      row.append(...cells);
      return row;
    }));
    document.getElementById("engines-empty").hidden = engines.length > 0;
  }

  function render(s) {
    const t = s.today;
    set("t-rpm", s.now.requests_per_min);
    set("t-tpm", s.now.tokens_per_min);
    set("t-requests", t.requests);
    set("t-neurons", t.neurons.toFixed(1));
    const meter = document.getElementById("t-neuron-meter");
    meter.max = t.free_neurons; meter.value = t.neurons; meter.hidden = t.paid_plan;
    set("t-free-note", t.paid_plan ? "paid plan" : "of " + t.free_neurons + " free");
    set("t-cost", "$" + t.cost_usd.toFixed(4));
    set("t-errors", pct(t.error_rate));
    set("t-latency", pair(t.p50_latency_ms, t.p95_latency_ms));
    set("t-ttft", pair(t.p50_ttft_ms, t.p95_ttft_ms));
    set("t-cache", pct(t.prefix_cache_hit_rate));
    set("t-spec", pct(t.spec_acceptance));
    document.getElementById("chart-empty").hidden = t.requests > 0;
    traffic.data.labels = s.series.labels;
    traffic.data.datasets[0].data = s.series.requests;
    traffic.data.datasets[1].data = s.series.tokens;
    traffic.update();
    latency.data.labels = s.series.labels;
    latency.data.datasets[0].data = s.series.p50_latency_ms;
    latency.data.datasets[1].data = s.series.p95_latency_ms;
    latency.data.datasets[2].data = s.series.p95_ttft_ms;
    latency.update();
    renderEngines(s.engines);
    document.body.dataset.requestsToday = t.requests;  // what the browser tests wait on
  }

  function connect(delay) {
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(proto + location.host + script.dataset.socket);
    socket.onopen = () => { state.dataset.state = "live"; state.textContent = "live"; delay = 1000; };
    socket.onmessage = (m) => { const msg = JSON.parse(m.data); if (msg.type === "overview") render(msg.data); };
    socket.onclose = () => {
      state.dataset.state = "offline"; state.textContent = "reconnecting…";
      setTimeout(() => connect(Math.min(delay * 2, 30000)), delay);
    };
  }

  render(initial);
  connect(1000);
})();
