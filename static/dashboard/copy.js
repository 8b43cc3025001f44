// Copy buttons: data-copy names the element whose text goes to the clipboard.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const text = document.getElementById(button.dataset.copy).textContent.trim();
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (err) {
    // No clipboard permission (plain http on another host): select the text so the user can copy it.
    const range = document.createRange();
    range.selectNodeContents(document.getElementById(button.dataset.copy));
    getSelection().removeAllRanges(); getSelection().addRange(range);
    button.textContent = "Press Ctrl+C";
  }
});
