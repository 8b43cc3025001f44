// The Usage pages: the daily chart of the summary, a loading state on its filter form, and the request log's
// htmx details (a 400 answer still shows its message; the log is marked busy while a page loads).
(function () {
  "use strict";

  const daily = document.getElementById("usage-daily");
  if (daily && window.Chart) {
    const data = JSON.parse(daily.textContent);
    // Small models cost fractions of a cent a day: keep significant digits, never "9E-7".
    const dollars = new Intl.NumberFormat("en-US", { style: "currency", currency: "USD", maximumSignificantDigits: 3 });
    const narrow = window.matchMedia("(max-width: 600px)").matches;
    new Chart(document.getElementById("daily-chart"), {
      type: "bar",
      data: {
        labels: data.labels,
        datasets: [
          { label: "Requests", data: data.requests, backgroundColor: "#e8772e", yAxisID: "requests" },
          { label: "Cost", data: data.cost_usd, type: "line", borderColor: "#3b6fb6", backgroundColor: "#3b6fb6",
            pointRadius: 2, tension: 0.2, yAxisID: "cost" },
        ],
      },
      options: {
        animation: false, maintainAspectRatio: false, interaction: { mode: "index", intersect: false },
        plugins: { tooltip: { callbacks: {
          label: (item) => item.dataset.label + ": " + (item.dataset.yAxisID === "cost" ? dollars.format(item.raw) : item.raw),
        } } },
        scales: {
          x: { ticks: { maxTicksLimit: narrow ? 4 : 10, maxRotation: 0 } },
          requests: { position: "left", beginAtZero: true, ticks: { precision: 0 }, title: { display: !narrow, text: "requests" } },
          cost: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false },
                  ticks: { maxTicksLimit: 6, callback: (value) => dollars.format(value) }, title: { display: false } },
        },
      },
    });
  }

  const filters = document.getElementById("usage-filters");
  if (filters) {
    filters.addEventListener("submit", () => {
      const button = filters.querySelector("button[type=submit]");
      button.textContent = button.dataset.loadingText;
      button.setAttribute("aria-busy", "true");
      document.body.classList.add("usage-loading");
    });
    // Back/forward cache: a page restored from it must not stay in its loading state.
    window.addEventListener("pageshow", () => {
      const button = filters.querySelector("button[type=submit]");
      button.textContent = "Apply";
      button.removeAttribute("aria-busy");
      document.body.classList.remove("usage-loading");
    });
  }

  document.body.addEventListener("htmx:beforeSwap", (event) => {
    // htmx leaves error answers unswapped; a bad filter's 400 carries the message the user needs to see.
    if (event.detail.xhr.status === 400) {
      event.detail.shouldSwap = true;
      event.detail.isError = false;
    }
  });
  document.body.addEventListener("htmx:beforeRequest", () => {
    const log = document.getElementById("log");
    if (log) log.setAttribute("aria-busy", "true");
  });
  document.body.addEventListener("htmx:afterRequest", () => {
    const log = document.getElementById("log");
    if (log) log.removeAttribute("aria-busy");  // a failed request leaves the old log in place
  });
  document.body.addEventListener("htmx:afterSettle", () => {
    document.body.dataset.logLoads = String(Number(document.body.dataset.logLoads || 0) + 1);  // tests wait on it
  });
})();
