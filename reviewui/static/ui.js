// The review page works without this file; it only saves clicks.
// Loaded from this origin (the Content-Security-Policy allows no inline script).
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  // The queue's filters apply as soon as one is chosen.
  var filters = document.getElementById("filters");
  if (filters) {
    filters.querySelectorAll("select").forEach(function (s) {
      s.addEventListener("change", function () { filters.submit(); });
    });
  }
  // A decision is sent once: a second click while the first is on its way
  // would only be refused as "not held".
  var decide = document.getElementById("decide");
  if (decide) {
    decide.addEventListener("submit", function () {
      var b = document.getElementById("submit-decision");
      if (b) { setTimeout(function () { b.disabled = true; }, 0); }
    });
  }
});
