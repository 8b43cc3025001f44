// The overview: render the snapshot the page came with, then every snapshot the server pushes over the socket.
(function () {
  "use strict";
  const script = document.currentScript;
  const initial = JSON.parse(document.getElementById("overview-snapshot").textContent);
  const state = document.getElementById("live-state");
  const pct = (x) => (x === null || x === undefined ? "–" : (x * 100).toFixed(1) + "%");
  const ms = (x) => (x === null || x === undefined ? "–" : Math.round(x) + " ms");
  const set = (id, text) => { document.getElementById(id).textContent = text; };

  const chart = new Chart(document.getElementById("usage-chart"), {
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

  function render(s) {
    set("t-rpm", s.now.requests_per_min);
    set("t-tpm", s.now.tokens_per_min);
    set("t-requests", s.today.requests);
    set("t-neurons", s.today.neurons.toFixed(1));
    set("t-free", s.today.free_neurons);
    const meter = document.getElementById("t-neuron-meter");
    meter.max = s.today.free_neurons; meter.value = s.today.neurons;
    set("t-cost", "$" + s.today.cost_usd.toFixed(4));
    set("t-errors", pct(s.today.error_rate));
    set("t-latency", ms(s.today.mean_latency_ms));
    set("t-ttft", ms(s.today.mean_ttft_ms));
    set("t-cache", pct(s.today.prefix_cache_hit_rate));
    set("t-spec", pct(s.today.spec_acceptance));
    document.getElementById("chart-empty").hidden = s.today.requests > 0;
    chart.data.labels = s.series.labels;
    chart.data.datasets[0].data = s.series.requests;
    chart.data.datasets[1].data = s.series.tokens;
    chart.update();
    document.body.dataset.requestsToday = s.today.requests;  // what the browser tests wait on
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
