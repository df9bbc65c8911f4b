/* The outbox overview's live part: fetched again every few seconds and put
   in place, so its counts, lag, warnings and tables stay current without a
   reload. Plain fetch(), no framework; it waits while the tab is hidden, and
   stops (saying so) once the session has ended. */
(function () {
  "use strict";
  var live = document.getElementById("outbox-live");
  if (!live || !window.fetch) {
    return;
  }
  var every = Number(live.dataset.refreshSeconds) * 1000;
  if (!(every > 0)) {
    return;
  }
  var timer = null;

  function say(text) {
    var status = document.getElementById("outbox-live-status");
    if (status) {
      status.textContent = text;
    }
  }

  function later() {
    clearTimeout(timer);
    timer = setTimeout(refresh, every);
  }

  function refresh() {
    if (document.hidden) {
      return; // visibilitychange refreshes when the tab is shown again
    }
    fetch(live.dataset.url, {
      credentials: "same-origin",
      headers: { "X-Requested-With": "XMLHttpRequest" },
    })
      .then(function (response) {
        if (response.redirected) {
          // To the login page: the session ended. Stop; a reload logs in.
          throw new Error("stop");
        }
        if (!response.ok) {
          return response.text().then(function (text) {
            throw new Error(text || String(response.status));
          });
        }
        return response.text();
      })
      .then(function (html) {
        live.innerHTML = html;
        live.dataset.refreshedAt = new Date().toISOString();
        later();
      })
      .catch(function (error) {
        if (error.message === "stop") {
          say("Live refresh stopped: the session ended. Reload the page.");
          return;
        }
        say("Live refresh failed (" + error.message + "); trying again.");
        later();
      });
  }

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) {
      refresh();
    }
  });
  later();
})();
