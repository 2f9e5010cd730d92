/**
 * The status-bar item: models cached, memory used of the budget, hit rate (as jupyter-resource-usage
 * shows memory). A click opens the side panel. Hooks for tests: `data-testid="overmind-statusbar"`,
 * `data-state` ("ok", "down", "error", "connecting") and `data-level` ("warn" from WARN_FRACTION of
 * the budget held, else "normal").
 */

import { Widget } from '@lumino/widgets';

import { heldFraction, OvermindModel, WARN_FRACTION } from './model';
import { hitRate, PSS_TEXT } from './texts';

export class OvermindStatus extends Widget {
  constructor(model: OvermindModel, open: () => void) {
    super({ node: document.createElement('button') });
    this.addClass('jp-Overmind-statusItem');
    this.node.dataset.testid = 'overmind-statusbar';
    this.node.addEventListener('click', open);
    this._model = model;
    model.changed.connect(this._update, this);
    this._update();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._update, this);
    super.dispose();
  }

  private _update(): void {
    const view = this._model.view;
    let text: string;
    let title: string;
    let warn = false;
    if (view.state === 'ok') {
      const n = view.entries_total;
      const rate = hitRate(view.stats).percent;
      text =
        `Overmind: ${n} model${n === 1 ? '' : 's'} · ${view.texts.used} / ${view.texts.budget}` +
        (rate === null ? '' : ` · ${rate}% hits`);
      const kernels = view.kernels.map(k => k.name).join(', ');
      title =
        `${n} cached model${n === 1 ? '' : 's'}, ${view.texts.used} of a ${view.texts.budget} budget, ` +
        `hits / misses ${hitRate(view.stats).text}` +
        (kernels ? `; kernels: ${kernels}` : '') +
        '. Click to open the Overmind panel.';
      const held = heldFraction(view);
      warn = held >= WARN_FRACTION;
      if (warn) {
        title =
          `The cache holds ${Math.round(held * 100)}% of its budget ` +
          `(${view.texts.used}` +
          (view.reserved > 0 ? ` and ${view.texts.reserved} reserved by loads in flight` : '') +
          ` of ${view.texts.budget}; the warning shows from ${Math.round(WARN_FRACTION * 100)}%): ` +
          'the next model loaded will evict the least recently used ones. Evict some in the panel, ' +
          'or raise the budget (OVERMIND_BUDGET). ' +
          title;
      }
      title += ` ${PSS_TEXT}`;
    } else if (view.state === 'down') {
      text = 'Overmind: no daemon';
      title = 'No overmind daemon runs yet; it starts with %overmind on in a notebook.';
    } else if (view.state === 'error') {
      text = 'Overmind: ?';
      title = view.message;
    } else {
      text = 'Overmind';
      title = 'Asking the server…';
    }
    this.node.dataset.state = view.state;
    this.node.dataset.level = warn ? 'warn' : 'normal';
    this.node.classList.toggle('jp-mod-warn', warn);
    this.node.textContent = text;
    this.node.title = title;
  }

  private _model: OvermindModel;
}
