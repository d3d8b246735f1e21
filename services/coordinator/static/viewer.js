// The episode viewer's one interaction: show or hide the loss mask over the decoded tokens.
document.addEventListener("DOMContentLoaded", function () {
  var button = document.getElementById("mask-toggle");
  if (!button) return;
  button.addEventListener("click", function () {
    var on = document.body.classList.toggle("show-mask");
    button.setAttribute("aria-pressed", on ? "true" : "false");
    button.textContent = on ? "Hide loss mask" : "Show loss mask";
  });
});
